// Package outbox delivers effects outside the database (an email, a payment,
// an HTTP call) from a dedupactivity EffectFunc, at least once and each with
// an idempotency key that is the same on every attempt.
//
// # Enqueue in the effect's transaction
//
// Inside an EffectFunc, Outbox.Enqueue writes a message through the effect's
// pgx.Tx: it commits exactly once, with the effect and its marker, or
// vanishes with them. Its key is derived from the event
// (dedupactivity.IdempotencyKey) and the message's name and position, so
// every attempt and redelivery of one event produces the same keys.
//
//	ob, _ := outbox.New(pool, outbox.Options{})
//	dedupactivity.Register(w, d, "Credit", func(ctx context.Context, tx pgx.Tx, in Posting) (Receipt, error) {
//		r, err := post(ctx, tx, in)
//		if err != nil {
//			return r, err
//		}
//		_, err = ob.Enqueue(ctx, tx, outbox.Message{Destination: "receipts", Name: "receipt", Payload: r})
//		return r, err
//	})
//
// # Relay
//
// A Relay sends due messages through a Sender (HTTPSender POSTs them with an
// Idempotency-Key header). Run it as a loop in every worker process
// (Relay.Run: low latency, no extra moving parts), or from a Temporal
// Schedule (RegisterRelay, EnsureRelaySchedule: each pass a visible
// workflow with its RelayResult), or both. Relays lease messages with FOR
// UPDATE SKIP LOCKED, so two relays do not send one message at the same
// time while its lease holds (a send is cut at the lease's end); a relay
// that dies between send and acknowledgement leaves a lease that expires,
// and the message is sent again with the same key. Failed
// sends back off exponentially; a permanent failure (ErrPermanent) or
// RelayConfig.MaxAttempts failures (stalled sends counted, sends given back
// by a stopping relay not) make the message dead, with its last error.
//
// # Reconciler
//
// A Reconciler asks destinations (a Checker: "did you apply key K?") about
// messages the relay cannot settle: unacknowledged past a bound, and dead.
// It marks them applied, re-queues them, marks them rejected when the
// destination refused them for good (ErrRejected), or reports them in its
// ReconcileReport. Run it from a Schedule (RegisterReconciler,
// EnsureReconcileSchedule).
//
// Outbox.Prune deletes settled messages (sent, applied, rejected) once
// Options.Retention has passed; run it from a Schedule too (RegisterPruner,
// EnsurePruneSchedule).
//
// # What is guaranteed
//
// A message is enqueued if and only if its effect commits, and is delivered
// at least once while its destination eventually accepts it; a destination
// that deduplicates on the key (the idemhttp middleware does) applies it
// once. Without that, a re-send can apply it twice: the outbox cannot make a
// destination idempotent.
package outbox
