package dedupactivity

import (
	"context"
	"encoding/hex"

	"go.temporal.io/sdk/activity"
)

// eventKey is the context key under which the effect's context carries its
// event.
type eventKey struct{}

// withEvent returns ctx carrying the identity hash of the event being applied:
// its marker's sum, which does not change once made, and a marker is never
// reused for another event.
func withEvent(ctx context.Context, hash *[32]byte) context.Context {
	return context.WithValue(ctx, eventKey{}, hash)
}

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
	if h, ok := ctx.Value(eventKey{}).(*[32]byte); ok {
		return "dedup-" + hex.EncodeToString(h[:]), true
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
	return "dedup-" + hex.EncodeToString(h[:]), true
}
