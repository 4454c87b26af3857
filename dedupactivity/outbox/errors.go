package outbox

import "errors"

// Sentinel errors. Errors returned by this package with one of these causes
// match it with errors.Is.
var (
	// ErrInvalidConfig is returned (wrapped, naming the field) by New,
	// NewRelay, NewHTTPSender and NewReconciler for invalid options, and by
	// DeadLetters and MarkRejected for an invalid argument.
	ErrInvalidConfig = errors.New("outbox: invalid configuration")

	// ErrInvalidMessage is returned by Enqueue for a message it cannot
	// store: no destination, a bad name, a payload that does not encode.
	// Returned from an EffectFunc as it is, it reaches Temporal as the
	// effect's own error, which Temporal retries; a message that can never
	// be stored is better returned as
	// temporal.NewNonRetryableApplicationError(err.Error(), "InvalidMessage", nil)
	// (a cause would be sent as one failure per level of its wrapping).
	ErrInvalidMessage = errors.New("outbox: invalid message")

	// ErrNoEventKey is returned by Enqueue called outside an EffectFunc (in
	// a plain activity, around a ClaimTx, outside Temporal) for a message
	// without an explicit Key.
	ErrNoEventKey = errors.New("outbox: no event in context: enqueue inside an EffectFunc or set Message.Key")

	// ErrDuplicateKey is returned by Enqueue when a message with the same
	// idempotency key is already stored: an explicit Key reused, by a
	// retry that already committed it or by another message.
	ErrDuplicateKey = errors.New("outbox: idempotency key already enqueued")

	// ErrNotMigrated is returned when the outbox table does not exist, or
	// lacks a column of a later migration: run Outbox.Migrate first.
	ErrNotMigrated = errors.New("outbox: outbox table missing or not migrated to this version (run Migrate)")

	// ErrPermanent marks a send error that retrying cannot fix (an HTTP 4xx
	// other than 408, 409, 425 and 429, a destination the Sender does not
	// know). The relay moves the message to StateDead at once. Senders wrap
	// it: fmt.Errorf("%w: ...", outbox.ErrPermanent).
	ErrPermanent = errors.New("outbox: permanent delivery failure")

	// ErrRejected is returned (wrapped) by a Checker when the destination
	// knows the message's key and refused the message for good (an HTTP
	// 3xx or 4xx it stored and replays): neither applied nor worth sending again.
	// The reconciler moves the message to StateRejected. HTTPChecker
	// returns it for idemhttp's StatusHandler answer to such a key (409
	// with the refusal's status in its body).
	ErrRejected = errors.New("outbox: rejected by the destination")

	// ErrNoMessage is returned (wrapped) by Requeue, MarkApplied and
	// MarkRejected for a key no message in the outbox has (or no longer:
	// Prune deleted it).
	ErrNoMessage = errors.New("outbox: no message with this idempotency key")

	// ErrNotDead is returned (wrapped, naming the message's state) by
	// Requeue, MarkApplied and MarkRejected for a message that is not
	// dead: a relay may be sending it, or it is settled.
	ErrNotDead = errors.New("outbox: message is not dead")

	// ErrUnknownDestination is returned (wrapping ErrPermanent) by
	// HTTPSender for a destination it has no URL for.
	ErrUnknownDestination = errors.New("outbox: unknown destination")
)
