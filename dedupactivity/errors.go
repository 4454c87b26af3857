package dedupactivity

import "errors"

// Sentinel errors. Every error returned by this package that has one of these
// causes matches it with errors.Is, also after it has been converted to a
// Temporal ApplicationError at the activity edge, in the worker's process.
// Past Temporal (the workflow, a client) errors.Is cannot match them: compare
// the ApplicationError's Type() with the ErrType constants.
var (
	// ErrPayloadMismatch is returned when an event identity that was already
	// claimed is delivered again with a different input and the Deduper's
	// MismatchPolicy is MismatchReject (the default), and, whatever the
	// policy, when a run-scoped identity is delivered by another activity
	// type than the one that applied it (two activities sharing a workflow
	// run and activity ID, as in Temporal's test environments). The stored effect is left untouched. At the activity
	// edge it becomes a non-retryable ApplicationError of type
	// ErrTypePayloadMismatch.
	ErrPayloadMismatch = errors.New("dedupactivity: same event identity delivered with a different payload")

	// ErrClaimTimeout is returned when another attempt holds the same event
	// (its transaction is still open) for longer than Options.ClaimWait. At the
	// activity edge it becomes a retryable ApplicationError of type
	// ErrTypeClaimTimeout, so Temporal tries again later.
	ErrClaimTimeout = errors.New("dedupactivity: another attempt holds the event past the claim wait bound")

	// ErrNotActivity is returned when a wrapped function is called with a
	// context that is not a Temporal activity context.
	ErrNotActivity = errors.New("dedupactivity: not called from a Temporal activity context")

	// ErrEmptyBusinessKey is returned when a business key function (see
	// WithBusinessKey) returns an empty key.
	ErrEmptyBusinessKey = errors.New("dedupactivity: empty business key")

	// ErrIdentityTooLarge is returned when an event identity encodes to more
	// than MaxIdentityBytes.
	ErrIdentityTooLarge = errors.New("dedupactivity: event identity too large")

	// ErrResultTooLarge is returned when an effect's encoded result exceeds
	// Options.MaxResultBytes. The effect is rolled back.
	ErrResultTooLarge = errors.New("dedupactivity: encoded result too large to store")

	// ErrEncoding is returned when the data converter cannot encode an input
	// or a result, or cannot decode a stored result (also a first
	// delivery's, read back before it commits). At the activity edge it
	// is an ApplicationError of type ErrTypeEncoding: non-retryable for an
	// input or a result (the effect is rolled back), retryable for a
	// duplicate's stored result (the effect is applied); either way the
	// converter's own ApplicationError, if its error holds one (a codec
	// whose key service is down, say), decides instead.
	ErrEncoding = errors.New("dedupactivity: payload encoding failed")

	// ErrNotMigrated is returned when the marker table or its function does
	// not exist, or the table lacks a column: run Deduper.Migrate (or apply the files in migrations/)
	// first, also after upgrading this package. It stays retryable at the
	// activity edge: the attempt succeeds once the table is there.
	ErrNotMigrated = errors.New("dedupactivity: marker table or function missing (run Migrate)")

	// ErrTxOwned is returned by the Commit and Rollback methods of the
	// pgx.Tx an effect is given, and by its SendBatch for a Batch that
	// begins a transaction (Batch.BeginTx): the claim commits the effect
	// together with its marker, or rolls both back when the effect returns
	// an error.
	ErrTxOwned = errors.New("dedupactivity: the claim transaction is committed or rolled back by dedupactivity, not by the effect")

	// ErrTxEnded is returned when an effect ended the claim transaction
	// itself with SQL (COMMIT or ROLLBACK); the message says which, and what
	// was committed. Nothing more is written for that attempt. If it was a
	// COMMIT, the event is marked without a result: later deliveries apply
	// nothing and, unless results are discarded (Options.DiscardResults),
	// fail with this error too. At the activity edge it becomes a
	// non-retryable ApplicationError of type ErrTypeInvalidUsage, so after a
	// ROLLBACK the effect is applied by a later delivery (a reset, or the
	// workflow's next call), not by Temporal's retries.
	ErrTxEnded = errors.New("dedupactivity: the effect ended the claim transaction")

	// ErrSearchPathChanged is returned when a statement of the claim that
	// runs after the effect's statements began (the marker's insert at
	// COMMIT, the result's update, a key inserted mid-effect) finds another
	// marker table by the table's name than the claim's first statement
	// did: the effect changed search_path (SET LOCAL search_path, a schema
	// per tenant) and Options.Schema is empty, so the name is unqualified.
	// Nothing of the attempt is committed; set Options.Schema. At the
	// activity edge it becomes a non-retryable ApplicationError of type
	// ErrTypeInvalidUsage. (A marker table dropped and made again while the
	// attempt ran reads the same.) The check raises through the table's
	// <table>_moved function, found through the same search_path: a schema
	// whose marker table lacks it fails as ErrNotMigrated instead.
	ErrSearchPathChanged = errors.New("dedupactivity: the marker table's name resolved to another table after the effect ran (it changed search_path): set Options.Schema")

	// ErrReadOnly is returned when the claim's transaction is read-only
	// (default_transaction_read_only, or a standby server): claiming writes
	// the marker. It stays retryable at the activity edge, since a
	// fail-over can make the same address writable again.
	ErrReadOnly = errors.New("dedupactivity: the database session is read-only; claims write a marker")

	// ErrInvalidIdentity is returned for an Identity that lacks a field its
	// Kind needs, or has an unknown Kind (a hand-built Identity given to Do
	// or ClaimTx).
	ErrInvalidIdentity = errors.New("dedupactivity: invalid event identity")

	// ErrSchemaTooNew is returned by Migrate when the marker table records
	// a migration version this package does not know: a newer release of
	// it migrated the table. Upgrade the package rather than run an older
	// one against the newer table.
	ErrSchemaTooNew = errors.New("dedupactivity: marker table migrated by a newer version of dedupactivity")

	// ErrInvalidOptions is returned (wrapped, naming the field) by New and
	// by wrapped activities built with invalid options.
	ErrInvalidOptions = errors.New("dedupactivity: invalid options")
)

// errDuplicate is what the effect's first statement returns when the claim
// sent with it finds the event applied (see claimTx). The delivery is then a
// duplicate: whatever the effect does or returns after it is rolled back
// and ignored, and the delivery returns the stored result.
var errDuplicate = errors.New("dedupactivity: this delivery is a duplicate (the event was applied by an earlier attempt): its statements are rolled back and it returns the stored result; return any error")

// errNotRidden says the effect's first statement could not carry the claim
// (the server would not prepare it, its arguments could not be encoded, or
// the connection does not cache statements): the claim was not sent with
// it; see claimTx.send.
var errNotRidden = errors.New("dedupactivity: the statement could not carry the claim")

// errEffectExited is what the telemetry of an attempt records when its
// effect ended the goroutine (runtime.Goexit, as t.FailNow does) instead of
// returning: the transaction is rolled back and nothing is returned.
var errEffectExited = errors.New("dedupactivity: the effect exited its goroutine (runtime.Goexit) without returning")

// Temporal ApplicationError types used at the activity edge. Workflows can
// match them with temporal.ApplicationError.Type(). Each says whether it is
// retryable; listing a retryable one in RetryPolicy.NonRetryableErrorTypes
// stops the retries that would settle it (a claim timeout, a stored result
// that decodes once the converter can).
const (
	// ErrTypePayloadMismatch marks a rejected payload mismatch (non-retryable).
	ErrTypePayloadMismatch = "DedupPayloadMismatch"
	// ErrTypeClaimTimeout marks an attempt that gave up waiting for another
	// attempt of the same event (retryable).
	ErrTypeClaimTimeout = "DedupClaimTimeout"
	// ErrTypeInvalidUsage marks a call that can never succeed as made: not an
	// activity context, an empty or too large identity, invalid options, an
	// effect that ends the claim's transaction or changes search_path
	// (non-retryable).
	ErrTypeInvalidUsage = "DedupInvalidUsage"
	// ErrTypeResultTooLarge marks a result over Options.MaxResultBytes
	// (non-retryable).
	ErrTypeResultTooLarge = "DedupResultTooLarge"
	// ErrTypeEncoding marks a value the data converter cannot encode or
	// decode (ErrEncoding): non-retryable for an input or a result (nothing
	// is committed), retryable for a duplicate's stored result (the effect is
	// applied, and a retry returns the result once it decodes). A
	// converter's own ApplicationError (a codec's) decides instead.
	ErrTypeEncoding = "DedupEncoding"
)

// error.type values of errors that stay plain Go errors at the activity edge.
const (
	errTypeNotMigrated = "DedupNotMigrated"
	errTypeReadOnly    = "DedupReadOnly"
)

// errorClasses maps this package's sentinels to their ApplicationError type
// and whether Temporal may retry them; toTemporal and the error.type
// telemetry attribute both read it.
var errorClasses = []errorClass{
	{ErrPayloadMismatch, ErrTypePayloadMismatch, true},
	{ErrClaimTimeout, ErrTypeClaimTimeout, false},
	{ErrNotActivity, ErrTypeInvalidUsage, true},
	{ErrEmptyBusinessKey, ErrTypeInvalidUsage, true},
	{ErrInvalidIdentity, ErrTypeInvalidUsage, true},
	{ErrIdentityTooLarge, ErrTypeInvalidUsage, true},
	{ErrInvalidOptions, ErrTypeInvalidUsage, true},
	{ErrTxOwned, ErrTypeInvalidUsage, true},
	{ErrTxEnded, ErrTypeInvalidUsage, true},
	{ErrSearchPathChanged, ErrTypeInvalidUsage, true},
	{ErrResultTooLarge, ErrTypeResultTooLarge, true},
	{ErrEncoding, ErrTypeEncoding, true},
	{ErrNotMigrated, errTypeNotMigrated, false},
	{ErrReadOnly, errTypeReadOnly, false},
}

type errorClass struct {
	sentinel     error
	typ          string
	nonRetryable bool
}

// classify finds the class of the first of this package's sentinels err
// matches.
func classify(err error) (c errorClass, ok bool) {
	for _, c := range errorClasses {
		if errors.Is(err, c.sentinel) {
			return c, true
		}
	}
	return errorClass{}, false
}
