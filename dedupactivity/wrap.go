package dedupactivity

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"time"

	"github.com/jackc/pgx/v5"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"

	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/event"
)

// EffectFunc is the user's database effect; it must do all its writes
// through tx. Its writes commit only in the attempt that claims the event,
// inside the claim transaction, which the claim owns: tx.Commit and
// tx.Rollback return ErrTxOwned (return an error to roll back), savepoints
// (tx.Begin) work, and tx is closed (pgx.ErrTxClosed) once the attempt ends.
// The transaction is READ COMMITTED, whatever the session's
// default_transaction_isolation: an effect that needs REPEATABLE READ or
// SERIALIZABLE claims with ClaimTx in a transaction it begins itself.
//
// The claim is sent with the effect's first statement when the delivery is
// almost surely new (the first attempt of a run-scoped identity, on a
// connection that caches statements; see Round trips in the package
// documentation), which saves a round trip. So on the rare
// duplicate among those, the effect is called and its first call on tx
// fails: the delivery is a duplicate, that statement ran in a transaction
// that is rolled back, and whatever the effect returns (or a panic) is
// ignored in favour of the stored result. What that statement did outside
// the transaction stays: a sequence's nextval, a session-level advisory lock
// on the pooled connection (a session-level set_config does not: PostgreSQL
// undoes it with the rollback). Once a call found the delivery a duplicate,
// every later call on tx returns that error, a deferred
// pg_advisory_unlock too (also when a concurrent attempt committed after
// the first statement, found by a later call's claim): take transaction
// locks (pg_advisory_xact_lock), which the rollback releases, not session
// ones. Calls on tx from a goroutine the effect started belong before the
// effect returns: one in flight then is waited for (it runs in the event's
// transaction, and the claim commits or rolls back after it), and every
// later one returns pgx.ErrTxClosed, so none reaches the connection once
// the attempt is over; two at once get "conn busy", as on any pgx.Tx. What
// tx.Conn and tx.LargeObjects give is not behind that: keep neither past
// the effect. tx.Conn (and a Rows' Conn) is nil while the effect's Rows
// are open before the event's key went in (on a first attempt, whose claim
// rides: the connection is busy, and the key cannot be sent): read what
// you need of the connection before a Query, or after its Rows are closed.
// Do not call external systems (email, payments, HTTP) from it; see the
// package documentation.
type EffectFunc[In, Out any] func(ctx context.Context, tx pgx.Tx, in In) (Out, error)

// WrapOption configures one wrapped activity.
type WrapOption interface{ apply(*wrapConfig) }

type wrapOptionFunc func(*wrapConfig)

func (f wrapOptionFunc) apply(c *wrapConfig) { f(c) }

type wrapConfig struct {
	keyFn     func(in any) (string, error)
	keyType   reflect.Type
	keyNil    bool
	retention time.Duration
}

// WithBusinessKey makes the event identity a key derived from the input (an
// order ID, a payment reference) instead of the workflow run: deliveries
// with the same key are one event across runs and workflows. Keys are scoped
// to the namespace and the activity type. The key must not be empty
// (ErrEmptyBusinessKey) and In must be the wrapped activity's input type.
//
// Deliveries of one key must carry the same input: a different one is a
// payload mismatch (see Options.MismatchPolicy). Two inputs are the same
// when their JSON encodings (as the default data converter makes them) are
// equal after object members whose value is null, false, 0, "", [] or {} are
// dropped and member order is ignored (an input that is itself one of these
// is null: a nil slice and an empty one are the same input). So adding a
// field to the input struct, or omitempty, changes nothing for inputs that
// leave it at a zero value whose JSON is one of these. A zero time.Time
// (JSON "0001-01-01T00:00:00Z"), a zero array ([0,0,...]) or a value whose
// zero text is not empty (a uuid.UUID's, a decimal's "0") is not: such a
// field added is a different input. Nor is the same instant in another time
// zone (its JSON keeps the offset), or a field removed from the struct that
// inputs set.
//
// An error from key fails the attempt before anything is claimed (it is
// traced and counted as OutcomeError, with its error.type). A
// *temporal.ApplicationError reaches Temporal unchanged, so
// temporal.NewNonRetryableApplicationError stops the retries of an input
// that has no key; any other error is retryable.
func WithBusinessKey[In any](key func(in In) (string, error)) WrapOption {
	return wrapOptionFunc(func(c *wrapConfig) {
		c.keyType = reflect.TypeFor[In]()
		c.keyNil = key == nil
		c.keyFn = func(in any) (string, error) {
			v, _ := in.(In) // a nil input (In an interface type) is In's zero value
			return key(v)
		}
	})
}

// WithRetention overrides Options.Retention for this activity. As
// Options.Retention, it must be at least a minute: Wrap and Register panic
// on less, and Do returns ErrInvalidOptions.
func WithRetention(d time.Duration) WrapOption {
	return wrapOptionFunc(func(c *wrapConfig) { c.retention = d })
}

// Wrap returns a Temporal activity function that applies fn at most once per
// event identity. It panics, as Register does, when d or fn is nil or an
// option does not fit the activity, so a misconfiguration stops the worker
// at start rather than failing every attempt.
//
// Register the returned function under an explicit name (a closure has no
// stable name of its own), or call it from a method of your activities
// struct so the method keeps its name and signature:
//
//	func (a *Activities) Debit(ctx context.Context, in Posting) (Receipt, error) {
//		return a.debit(ctx, in) // a.debit = dedupactivity.Wrap(d, a.applyDebit), set once
//	}
//
// Errors reach Temporal as follows: the effect's own errors unchanged; a
// rejected payload mismatch, an invalid call (not an activity context, empty
// business key, an effect that ended the transaction) and values the data
// converter cannot encode (or decode back) as non-retryable
// ApplicationErrors (ErrType* constants); a claim timeout, and a
// duplicate's stored result the converter cannot decode, as retryable
// ones; database errors as they are (retryable).
func Wrap[In, Out any](d *Deduper, fn EffectFunc[In, Out], opts ...WrapOption) func(ctx context.Context, in In) (Out, error) {
	w, err := newWrapper(d, fn, opts)
	if err != nil {
		panic(fmt.Sprintf("dedupactivity: Wrap: %v", err))
	}
	return w.run
}

// Register wraps fn and registers it on r under name. It panics, as the
// SDK's own registration does, when name is empty, d or fn is nil, or an
// option does not fit the activity.
func Register[In, Out any](r worker.ActivityRegistry, d *Deduper, name string, fn EffectFunc[In, Out], opts ...WrapOption) {
	if name == "" {
		panic("dedupactivity: Register needs a non-empty activity name")
	}
	w, err := newWrapper(d, fn, opts)
	if err != nil {
		panic(fmt.Sprintf("dedupactivity: Register %q: %v", name, err))
	}
	r.RegisterActivityWithOptions(w.run, activity.RegisterOptions{Name: name})
}

type wrapper[In, Out any] struct {
	d   *Deduper
	fn  EffectFunc[In, Out]
	cfg wrapConfig
}

func newWrapper[In, Out any](d *Deduper, fn EffectFunc[In, Out], opts []WrapOption) (*wrapper[In, Out], error) {
	if !d.made() {
		return nil, fmt.Errorf("%w: Deduper is nil, or not made by New", ErrInvalidOptions)
	}
	if fn == nil {
		return nil, fmt.Errorf("%w: EffectFunc is nil", ErrInvalidOptions)
	}
	w := &wrapper[In, Out]{d: d, fn: fn, cfg: wrapConfig{retention: d.opts.Retention}}
	for _, o := range opts {
		if o != nil {
			o.apply(&w.cfg)
		}
	}
	switch {
	case w.cfg.keyNil:
		return nil, fmt.Errorf("%w: WithBusinessKey needs a key function, got nil", ErrInvalidOptions)
	case w.cfg.keyFn != nil && w.cfg.keyType != reflect.TypeFor[In]():
		return nil, fmt.Errorf("%w: WithBusinessKey takes %s, the activity's input is %s", ErrInvalidOptions, w.cfg.keyType, reflect.TypeFor[In]())
	case w.cfg.keyFn != nil && d.opts.PartitionInterval > 0:
		return nil, fmt.Errorf("%w: WithBusinessKey cannot be used with the partitioned layout (PartitionInterval): deliveries of one key do not share a ScheduledTime", ErrInvalidOptions)
	case w.cfg.retention < time.Minute:
		return nil, fmt.Errorf("%w: WithRetention must be at least 1m, got %s", ErrInvalidOptions, w.cfg.retention)
	}
	return w, nil
}

// Do applies fn at most once for the event identity id, with the same
// transaction, result storage, mismatch policy and telemetry as a wrapped
// activity, but with an identity of your choosing and errors left as this
// package's own (not converted to Temporal errors). Use it to deduplicate
// work that is not a Temporal activity, such as a message consumer; inside
// an activity, prefer Wrap. The Outcome says what happened: OutcomeClaimed
// when fn ran and committed, OutcomeDuplicate (or OutcomePayloadMismatch
// under MismatchReturnStored) when the stored result was returned. Both
// return the result as the data converter decodes it from what was stored,
// so a first delivery and a duplicate return equal values (a wrapped
// activity's too); with Options.DiscardResults a first delivery returns
// fn's value and a duplicate the zero value. Inputs are compared for a
// KindBusinessKey id only, as for a wrapped activity, whose run-scoped
// input Temporal's history fixes: under a run-scoped id of your own, a
// delivery with another input is a duplicate, and returns the first one's
// result. WithBusinessKey does not apply (id is the identity) and is
// refused. Outside an activity a run-scoped id (KindActivity,
// KindStandalone) is taken for a first attempt: its claim rides with fn's
// first statement (see Round trips in the package documentation); for work
// that is often delivered again, such as a queue consumer's, use a
// KindBusinessKey id, which claims before fn runs.
func Do[In, Out any](ctx context.Context, d *Deduper, id Identity, in In, fn EffectFunc[In, Out], opts ...WrapOption) (Out, Outcome, error) {
	var zero Out
	w, err := newWrapper(d, fn, opts)
	if err != nil {
		return zero, OutcomeError, err
	}
	if w.cfg.keyFn != nil {
		return zero, OutcomeError, fmt.Errorf("%w: Do takes its identity as an argument; WithBusinessKey does not apply", ErrInvalidOptions)
	}
	out, a, err := w.apply(ctx, infoFor(ctx, id), id, in)
	return out, a.outcome, err
}

// run is the activity function.
func (w *wrapper[In, Out]) run(ctx context.Context, in In) (Out, error) {
	var zero Out
	if !activity.IsActivity(ctx) {
		return zero, toTemporal(ErrNotActivity)
	}
	info := activity.GetInfo(ctx)
	id := IdentityFromInfo(info)
	if w.cfg.keyFn != nil {
		id = Identity{Kind: KindBusinessKey, Namespace: info.Namespace, ActivityType: info.ActivityType.Name}
		key, err := w.cfg.keyFn(in)
		if err != nil {
			if !errors.As(err, new(*temporal.ApplicationError)) {
				err = toTemporal(fmt.Errorf("dedupactivity: business key: %w", err))
			} // else the key function's own, unchanged, as the effect's
			w.d.tel.failed(ctx, info, id, nil, err)
			return zero, err
		}
		id.Key = key
	}
	out, a, err := w.apply(ctx, info, id, in)
	if a.outcome == OutcomeEffectError {
		return out, err // the effect's own error reaches Temporal unchanged
	}
	return out, toTemporal(err)
}

// apply runs one attempt of the event id: it validates the identity,
// fingerprints a business-keyed input, traces the attempt, and claims and
// applies. An identity it refuses is traced and counted too. A first
// delivery returns the effect's value as the data converter decodes it from
// what was stored, which is what a duplicate returns.
func (w *wrapper[In, Out]) apply(ctx context.Context, info activity.Info, id Identity, in In) (out Out, a attempt, err error) {
	a.outcome = OutcomeError
	m, err := w.d.newMarker(info, id, w.cfg.retention)
	if err != nil {
		w.d.tel.failed(ctx, info, id, nil, err)
		return out, a, err
	}
	if w.d.opts.PartitionInterval > 0 {
		if id.Kind != KindActivity && id.Kind != KindStandalone || info.ScheduledTime.IsZero() {
			err = fmt.Errorf("%w: the partitioned layout (PartitionInterval) supports run-scoped identities of regular and standalone activities only, not %s identities or calls outside an activity: their deliveries do not share a ScheduledTime", ErrInvalidOptions, id.Kind)
			w.d.tel.failed(ctx, info, id, m.sum[:], err)
			return out, a, err
		}
		m.scheduledAt = info.ScheduledTime
	}

	ctx, rec := w.d.tel.start(ctx, info, id, m.sum)
	ctx = event.With(ctx, &m.sum)
	var panicked effectPanic
	effectReturned := false // w.fn returned: a panic after it is the converter's
	defer func() {
		r := recover()
		if r == nil && !panicked.set {
			rec.set(a)
			w.d.tel.end(ctx, rec, err)
			return
		}
		// A panic, or an effect that ended its goroutine (runtime.Goexit,
		// as t.FailNow does), which recover does not see. claim left what
		// the attempt took in panicked when it came from the function it
		// ran: the effect's, or the DataConverter's on the effect's result
		// after it returned. Any other panic is not the effect's: the
		// library's own, or the converter's on a duplicate's stored result
		// after claim returned what it took (a has no claim wait when
		// claim did not return).
		if panicked.set {
			a, rec.noClaim = panicked.a, !panicked.claimed
			a.outcome = OutcomeEffectError
			if effectReturned {
				a.outcome = OutcomeError
			}
		} else {
			a.outcome, rec.noClaim = OutcomeError, rec.noClaim || a.claimWait == 0
		}
		rec.set(a)
		if r == nil {
			w.d.tel.end(ctx, rec, errEffectExited)
			return
		}
		w.d.tel.end(ctx, rec, fmt.Errorf("panic: %v", r))
		panic(r)
	}()

	if err = fingerprintInput(m, id, in); err != nil {
		rec.noClaim = true // failed before its claim: no claim duration
		return out, a, err
	}

	dc := w.d.resultConverter(ctx, info, id)
	var claimedOut Out
	a, err = w.d.claim(ctx, m, mayRide(id, info), func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		o, err := w.fn(ctx, tx, in)
		effectReturned = true
		if err != nil {
			return nil, effectError{err}
		}
		b, err := w.d.encodeResult(dc, o)
		if err != nil {
			return nil, err
		}
		claimedOut, err = asStored(dc, b, o) // what a duplicate returns
		return b, err
	}, &panicked)
	if err != nil {
		if ee := (effectError{}); errors.As(err, &ee) {
			err = ee.err // the effect's own error, unchanged
		}
		return out, a, err
	}
	if a.outcome == OutcomeClaimed {
		return claimedOut, a, nil
	}
	if len(a.result) == 0 {
		return out, a, nil // results are not stored: the zero value
	}
	if err := decodeResult(dc, a.result, &out); err != nil {
		a.outcome = OutcomeError
		return out, a, storedResultError{err}
	}
	return out, a, nil
}

// storedResultError is a duplicate's stored result that the converter could
// not decode. The event is applied, so at the activity edge the attempt is
// retryable, as the SDK's for an input it cannot decode: a retry returns the
// result once the converter reads it (a codec's key service back, a deploy
// that reads the old type), where a non-retryable failure would tell the
// workflow the effect did not happen.
type storedResultError struct{ err error }

func (e storedResultError) Error() string { return e.err.Error() }
func (e storedResultError) Unwrap() error { return e.err }

// mayRide says whether the claim of a delivery may ride with its effect's
// first statement (see claimTx), which saves a round trip and a row version
// but runs that statement (rolled back) if the delivery turns out to be a
// duplicate, and the whole effect if another attempt runs at the same time.
// It may for the first attempt of a regular or standalone activity's
// run-scoped identity, which is almost always new: such an identity is
// delivered again by Temporal's retries (attempt 2 on), or after an
// operator reset the activity. Retries, business keys (which other
// workflows may share) and local activities (which a new workflow task may
// run again from attempt 1) claim first.
func mayRide(id Identity, info activity.Info) bool {
	return (id.Kind == KindActivity || id.Kind == KindStandalone) && info.Attempt <= 1
}

// toTemporal converts this package's errors to Temporal errors at the
// activity edge. The effect's own errors never come here (run returns them
// unchanged).
func toTemporal(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := err.(*temporal.ApplicationError); ok {
		return err // the SDK converts an error by its top-level type
	}
	c, ok := classify(err)
	if !ok || c.typ == errTypeNotMigrated || c.typ == errTypeReadOnly {
		return err // retryable as it is: a migration or a fail-over fixes it
	}
	nonRetryable := c.nonRetryable
	if c.typ == ErrTypeEncoding {
		var appErr *temporal.ApplicationError
		switch {
		case errors.As(err, &appErr):
			// The converter's (a codec's) own verdict: a key service that
			// is down says retryable.
			nonRetryable = appErr.NonRetryable()
		case errors.As(err, new(storedResultError)):
			nonRetryable = false // applied: see storedResultError
		}
	}
	return temporal.NewApplicationErrorWithOptions(err.Error(), c.typ, temporal.ApplicationErrorOptions{
		NonRetryable: nonRetryable, Cause: &sentinel{is: c.sentinel, err: err}})
}

// sentinel is the cause of the ApplicationError toTemporal makes: it reads
// as err's sentinel, and answers errors.Is and errors.As for err's whole
// chain in the worker's process. It has no Unwrap: the SDK's failure
// converter follows Unwrap, and would send one cause per level of
// wrapping, each repeating the message, to the workflow and the UI (where
// this cause shows as of type "sentinel").
type sentinel struct {
	is  error
	err error
}

func (c *sentinel) Error() string        { return c.is.Error() }
func (c *sentinel) Is(target error) bool { return errors.Is(c.err, target) }
func (c *sentinel) As(target any) bool   { return errors.As(c.err, target) }
