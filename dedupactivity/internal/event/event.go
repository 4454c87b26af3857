// Package event carries, in an EffectFunc's context, the event the effect
// applies, for the dedupactivity packages that derive keys from it (the
// outbox derives its messages' keys only under the event's claim).
package event

import (
	"context"
	"encoding/hex"
)

// ctxKey is the context key under which an effect's context carries its
// event.
type ctxKey struct{}

// With returns ctx carrying the identity hash of the event being applied:
// its marker's sum, which does not change once made.
func With(ctx context.Context, hash *[32]byte) context.Context {
	return context.WithValue(ctx, ctxKey{}, hash)
}

// Key returns the idempotency key of the event ctx carries (see With), or
// "", false when ctx is not an effect's.
func Key(ctx context.Context) (string, bool) {
	h, ok := ctx.Value(ctxKey{}).(*[32]byte)
	if !ok {
		return "", false
	}
	return KeyOf(h), true
}

// KeyOf is the idempotency key of the event whose identity hash is h: the
// hex SHA-256 of the identity, prefixed "dedup-".
func KeyOf(h *[32]byte) string { return "dedup-" + hex.EncodeToString(h[:]) }
