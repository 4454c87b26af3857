package dedupactivity

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"time"

	"github.com/jackc/pgx/v5"
	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"
	"google.golang.org/protobuf/proto"
)

// EffectFunc is the user's database effect; it must do all its writes
// through tx. It runs only in the attempt that claims the event, inside the
// claim transaction: do not commit or roll back tx, and do not call external
// systems (email, payments, HTTP) from it; see the package documentation.
type EffectFunc[In, Out any] func(ctx context.Context, tx pgx.Tx, in In) (Out, error)

// WrapOption configures one wrapped activity.
type WrapOption interface{ apply(*wrapConfig) }

type wrapOptionFunc func(*wrapConfig)

func (f wrapOptionFunc) apply(c *wrapConfig) { f(c) }

type wrapConfig struct {
	keyFn     func(in any) (string, error)
	keyType   reflect.Type
	retention time.Duration
}

// WithBusinessKey makes the event identity a key derived from the input (an
// order ID, a payment reference) instead of the workflow run: deliveries
// with the same key are one event across runs and workflows. Keys are scoped
// to the namespace and the activity type. The key must not be empty
// (ErrEmptyBusinessKey) and In must be the wrapped activity's input type.
func WithBusinessKey[In any](key func(in In) (string, error)) WrapOption {
	return wrapOptionFunc(func(c *wrapConfig) {
		c.keyType = reflect.TypeFor[In]()
		c.keyFn = func(in any) (string, error) { return key(in.(In)) }
	})
}

// WithRetention overrides Options.Retention for this activity.
func WithRetention(d time.Duration) WrapOption {
	return wrapOptionFunc(func(c *wrapConfig) { c.retention = d })
}

// Wrap returns a Temporal activity function that applies fn at most once per
// event identity. Register it under an explicit name (see Register): a
// closure has no stable name of its own.
//
// Errors reach Temporal as follows: the effect's own errors unchanged; a
// rejected payload mismatch, an invalid call (not an activity context, empty
// business key, invalid options) and values the data converter cannot
// handle as non-retryable ApplicationErrors (ErrType* constants); a claim
// timeout as a retryable ApplicationError; database errors as they are
// (retryable).
func Wrap[In, Out any](d *Deduper, fn EffectFunc[In, Out], opts ...WrapOption) func(ctx context.Context, in In) (Out, error) {
	w, err := newWrapper(d, fn, opts)
	if err != nil {
		return func(context.Context, In) (Out, error) {
			var zero Out
			return zero, toTemporal(err)
		}
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
	if d == nil {
		return nil, fmt.Errorf("%w: Deduper is nil", ErrInvalidOptions)
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
	if w.cfg.keyFn != nil && w.cfg.keyType != reflect.TypeFor[In]() {
		return nil, fmt.Errorf("%w: WithBusinessKey takes %s, the activity's input is %s", ErrInvalidOptions, w.cfg.keyType, reflect.TypeFor[In]())
	}
	if w.cfg.keyFn != nil && d.opts.PartitionInterval > 0 {
		return nil, fmt.Errorf("%w: WithBusinessKey cannot be used with the partitioned layout (PartitionInterval): deliveries of one key do not share a ScheduledTime", ErrInvalidOptions)
	}
	if w.cfg.retention < time.Minute {
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
// under MismatchReturnStored) when the stored result was returned.
func Do[In, Out any](ctx context.Context, d *Deduper, id Identity, in In, fn EffectFunc[In, Out], opts ...WrapOption) (Out, Outcome, error) {
	w, err := newWrapper(d, fn, opts)
	if err != nil {
		var zero Out
		return zero, OutcomeError, err
	}
	var info activity.Info
	if activity.IsActivity(ctx) {
		info = activity.GetInfo(ctx)
	}
	if info.ActivityType.Name == "" {
		info.ActivityType.Name = id.ActivityType
	}
	return w.apply(ctx, info, id, in)
}

// run is the activity function.
func (w *wrapper[In, Out]) run(ctx context.Context, in In) (Out, error) {
	if !activity.IsActivity(ctx) {
		var zero Out
		return zero, toTemporal(ErrNotActivity)
	}
	info := activity.GetInfo(ctx)
	id := IdentityFromInfo(info)
	if w.cfg.keyFn != nil {
		key, err := w.cfg.keyFn(in)
		if err != nil {
			var zero Out
			return zero, toTemporal(fmt.Errorf("dedupactivity: business key: %w", err))
		}
		id = Identity{Kind: KindBusinessKey, Namespace: info.Namespace, ActivityType: info.ActivityType.Name, Key: key}
	}
	out, outcome, err := w.apply(ctx, info, id, in)
	if outcome == OutcomeEffectError {
		return out, err // the effect's own error reaches Temporal unchanged
	}
	return out, toTemporal(err)
}

// apply runs one attempt of the event id: it validates the identity,
// fingerprints the input, traces the attempt, and claims and applies.
func (w *wrapper[In, Out]) apply(ctx context.Context, info activity.Info, id Identity, in In) (out Out, outcome Outcome, err error) {
	ev := &event{id: id, enc: id.Encode(), activityType: info.ActivityType.Name, attempt: info.Attempt, retention: w.cfg.retention}
	if err := id.validate(ev.enc); err != nil {
		return out, OutcomeError, err
	}
	ev.hash = sha256Sum(ev.enc)
	if w.d.opts.PartitionInterval > 0 {
		if id.Kind != KindActivity && id.Kind != KindStandalone || info.ScheduledTime.IsZero() {
			return out, OutcomeError, fmt.Errorf("%w: the partitioned layout (PartitionInterval) supports run-scoped identities of regular and standalone activities only, not %s identities or calls outside an activity: their deliveries do not share a ScheduledTime", ErrInvalidOptions, id.Kind)
		}
		ev.scheduledAt = info.ScheduledTime
	}
	if info.ScheduleToCloseTimeout > 0 && !info.ScheduledTime.IsZero() {
		ev.minExpiry = info.ScheduledTime.Add(info.ScheduleToCloseTimeout)
	}

	ctx, rec := w.d.tel.start(ctx, info, id, ev.hash)
	ctx = withEvent(ctx, ev.hash)
	defer func() {
		if r := recover(); r != nil {
			rec.outcome = OutcomeEffectError
			w.d.tel.end(ctx, rec, fmt.Errorf("panic: %v", r))
			panic(r)
		}
		w.d.tel.end(ctx, rec, err)
		outcome = rec.outcome
	}()

	if ev.fingerprint, err = fingerprint(in); err != nil {
		rec.outcome = OutcomeError
		return out, OutcomeError, err
	}

	var claimedOut Out
	result, err := w.d.apply(ctx, ev, rec, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		o, err := w.fn(ctx, tx, in)
		if err != nil {
			return nil, effectError{err}
		}
		claimedOut = o
		return w.encode(o)
	})
	if err != nil {
		var ee effectError
		if errors.As(err, &ee) {
			err = ee.err // the effect's own error, unchanged
		}
		return out, rec.outcome, err
	}
	if rec.outcome == OutcomeClaimed {
		return claimedOut, rec.outcome, nil
	}
	// A duplicate, possibly found only when the marker insert conflicted
	// after the effect ran (and rolled back): its output is not the result.
	if result == nil {
		return out, rec.outcome, nil // results are not stored: the zero value
	}
	if err := w.decode(result, &out); err != nil {
		rec.outcome = OutcomeError
		return out, OutcomeError, err
	}
	return out, rec.outcome, nil
}

func (w *wrapper[In, Out]) encode(o Out) ([]byte, error) {
	if w.d.opts.DiscardResults {
		return nil, nil
	}
	p, err := w.d.opts.DataConverter.ToPayload(o)
	if err != nil {
		return nil, fmt.Errorf("%w: encode result: %w", ErrEncoding, err)
	}
	b, err := proto.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("%w: marshal result payload: %w", ErrEncoding, err)
	}
	if len(b) > w.d.opts.MaxResultBytes {
		return nil, fmt.Errorf("%w: %d bytes encoded, MaxResultBytes is %d", ErrResultTooLarge, len(b), w.d.opts.MaxResultBytes)
	}
	return b, nil
}

func (w *wrapper[In, Out]) decode(b []byte, out *Out) error {
	var p commonpb.Payload
	if err := proto.Unmarshal(b, &p); err != nil {
		return fmt.Errorf("%w: unmarshal stored result: %w", ErrEncoding, err)
	}
	if err := w.d.opts.DataConverter.FromPayload(&p, out); err != nil {
		return fmt.Errorf("%w: decode stored result: %w", ErrEncoding, err)
	}
	return nil
}

// toTemporal converts this package's errors to Temporal errors at the
// activity edge. The effect's own errors never come here (run returns them
// unchanged).
func toTemporal(err error) error {
	if err == nil {
		return nil
	}
	var appErr *temporal.ApplicationError
	if errors.As(err, &appErr) {
		return err
	}
	switch {
	case errors.Is(err, ErrPayloadMismatch):
		return temporal.NewNonRetryableApplicationError(err.Error(), ErrTypePayloadMismatch, err)
	case errors.Is(err, ErrClaimTimeout):
		return temporal.NewApplicationErrorWithCause(err.Error(), ErrTypeClaimTimeout, err)
	case errors.Is(err, ErrNotActivity), errors.Is(err, ErrEmptyBusinessKey),
		errors.Is(err, ErrIdentityTooLarge), errors.Is(err, ErrInvalidOptions):
		return temporal.NewNonRetryableApplicationError(err.Error(), ErrTypeInvalidUsage, err)
	case errors.Is(err, ErrResultTooLarge):
		return temporal.NewNonRetryableApplicationError(err.Error(), ErrTypeResultTooLarge, err)
	case errors.Is(err, ErrEncoding):
		return temporal.NewNonRetryableApplicationError(err.Error(), ErrTypeEncoding, err)
	}
	return err
}
