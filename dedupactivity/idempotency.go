package dedupactivity

import (
	"context"

	"go.temporal.io/sdk/activity"

	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/event"
)

// IdempotencyKey returns a key that is the same for every attempt and every
// redelivery of one event, and different for different events: the hex
// SHA-256 of the event identity, prefixed "dedup-". Send it to systems that
// deduplicate on a key (an Idempotency-Key header, a payment provider's
// idempotency key), so a call repeated by a retry is applied once there.
//
// Inside an EffectFunc it is the key of the event being applied (a business
// key's when WithBusinessKey is used). In any other activity context it is
// the key of the activity's run-scoped identity (IdentityFromInfo), also
// around a ClaimTx, whose identity ctx does not carry: there, use "dedup-"
// and the hex of the claimed id's Hash. Outside both it returns "", false.
func IdempotencyKey(ctx context.Context) (string, bool) {
	if k, ok := event.Key(ctx); ok {
		return k, true
	}
	if !activity.IsActivity(ctx) {
		return "", false
	}
	id := IdentityFromInfo(activity.GetInfo(ctx))
	enc := id.Encode()
	if id.validate(enc) != nil {
		return "", false
	}
	h := sha256Sum(enc)
	return event.KeyOf(&h), true
}
