package dedupactivity

import (
	"context"
	"encoding/hex"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.temporal.io/sdk/activity"
)

// ScopeName is the instrumentation scope of this package's tracer and meter.
const ScopeName = "github.com/dedupactivity/dedupactivity/dedupactivity"

// Span attribute keys set on every attempt's span.
const (
	// OutcomeKey is the attempt's Outcome (claimed, duplicate, ...).
	OutcomeKey = attribute.Key("dedup.outcome")
	// IdentityKindKey is the identity's Kind (activity, local_activity,
	// standalone, business_key).
	IdentityKindKey = attribute.Key("dedup.identity.kind")
	// IdentityHashKey is the hex SHA-256 of the identity encoding: the
	// marker's primary key. Raw identities (business keys in particular) are
	// not recorded, so no user data reaches the tracing backend.
	IdentityHashKey = attribute.Key("dedup.identity.hash")
	// ClaimWaitKey is the time, in seconds, spent claiming the event
	// (including waiting for another attempt that held it).
	ClaimWaitKey = attribute.Key("dedup.claim.wait")
	// StoredAttemptKey is, on a duplicate, the attempt number that applied
	// the effect.
	StoredAttemptKey = attribute.Key("dedup.stored.attempt")
	// ActivityTypeKey is the Temporal activity type.
	ActivityTypeKey = attribute.Key("temporal.activity.type")
	// ActivityIDKey is the Temporal activity ID.
	ActivityIDKey = attribute.Key("temporal.activity.id")
	// AttemptKey is the Temporal attempt number (starts at 1; not monotonic
	// across activity resets).
	AttemptKey = attribute.Key("temporal.activity.attempt")
	// WorkflowIDKey is the workflow ID (empty for standalone activities).
	WorkflowIDKey = attribute.Key("temporal.workflow.id")
	// RunIDKey is the workflow run ID (empty for standalone activities).
	RunIDKey = attribute.Key("temporal.run.id")
	// NamespaceKey is the Temporal namespace.
	NamespaceKey = attribute.Key("temporal.namespace")
	// DBSystemKey is the OpenTelemetry semantic convention db.system.name,
	// always "postgresql".
	DBSystemKey = attribute.Key("db.system.name")
)

// Metric names.
const (
	// MetricAttempts counts wrapped attempts by dedup.outcome and
	// temporal.activity.type. Unit {attempt}.
	MetricAttempts = "dedup.attempts"
	// MetricClaimDuration is the time spent claiming an event, in seconds,
	// by dedup.outcome and temporal.activity.type.
	MetricClaimDuration = "dedup.claim.duration"
	// MetricEffectDuration is the time the user's effect ran, in seconds, by
	// dedup.outcome and temporal.activity.type.
	MetricEffectDuration = "dedup.effect.duration"
)

// Outcome is what one attempt did.
type Outcome string

// Outcomes, recorded in the OutcomeKey span attribute and the MetricAttempts
// counter.
const (
	// OutcomeClaimed: this attempt claimed the event and committed its effect.
	OutcomeClaimed Outcome = "claimed"
	// OutcomeDuplicate: the event was already applied; nothing ran, the
	// stored result was returned.
	OutcomeDuplicate Outcome = "duplicate"
	// OutcomePayloadMismatch: the event was already applied with a different
	// input (rejected, or returned the stored result under
	// MismatchReturnStored).
	OutcomePayloadMismatch Outcome = "payload_mismatch"
	// OutcomeEffectError: the effect returned an error (or panicked); all
	// was rolled back.
	OutcomeEffectError Outcome = "effect_error"
	// OutcomeClaimTimeout: another attempt held the event past ClaimWait.
	OutcomeClaimTimeout Outcome = "claim_timeout"
	// OutcomeError: an infrastructure or usage error (database, encoding,
	// invalid input); all was rolled back.
	OutcomeError Outcome = "error"
)

type telemetry struct {
	tracer   trace.Tracer
	attempts metric.Int64Counter
	claim    metric.Float64Histogram
	effect   metric.Float64Histogram
}

func newTelemetry(tp trace.TracerProvider, mp metric.MeterProvider) (*telemetry, error) {
	meter := mp.Meter(ScopeName)
	t := &telemetry{tracer: tp.Tracer(ScopeName)}
	var err error
	if t.attempts, err = meter.Int64Counter(MetricAttempts,
		metric.WithDescription("Wrapped activity attempts by dedup outcome."),
		metric.WithUnit("{attempt}")); err != nil {
		return nil, fmt.Errorf("create %s: %w", MetricAttempts, err)
	}
	buckets := metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
	if t.claim, err = meter.Float64Histogram(MetricClaimDuration,
		metric.WithDescription("Time spent claiming an event, including waiting for a concurrent attempt."),
		metric.WithUnit("s"), buckets); err != nil {
		return nil, fmt.Errorf("create %s: %w", MetricClaimDuration, err)
	}
	if t.effect, err = meter.Float64Histogram(MetricEffectDuration,
		metric.WithDescription("Time the wrapped effect ran inside the claim transaction."),
		metric.WithUnit("s"), buckets); err != nil {
		return nil, fmt.Errorf("create %s: %w", MetricEffectDuration, err)
	}
	return t, nil
}

// record is the telemetry of one attempt, filled while it runs.
type record struct {
	span          trace.Span
	activityType  string
	outcome       Outcome
	claimWait     time.Duration
	effectTime    time.Duration
	ranEffect     bool
	storedAttempt int32
}

// set copies what the claim returned into the record.
func (r *record) set(a attempt) {
	r.outcome, r.claimWait, r.effectTime, r.ranEffect, r.storedAttempt = a.outcome, a.claimWait, a.effectTime, a.ranEffect, a.storedAttempt
}

func (t *telemetry) start(ctx context.Context, info activity.Info, id Identity, hash [32]byte) (context.Context, *record) {
	ctx, span := t.tracer.Start(ctx, "Dedup:"+info.ActivityType.Name,
		trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(
			DBSystemKey.String("postgresql"),
			ActivityTypeKey.String(info.ActivityType.Name),
			ActivityIDKey.String(info.ActivityID),
			AttemptKey.Int64(int64(info.Attempt)),
			WorkflowIDKey.String(info.WorkflowExecution.ID),
			RunIDKey.String(info.WorkflowExecution.RunID),
			NamespaceKey.String(info.Namespace),
			IdentityKindKey.String(id.Kind.String()),
			IdentityHashKey.String(hex.EncodeToString(hash[:])),
		))
	return ctx, &record{span: span, activityType: info.ActivityType.Name}
}

// end closes the span and records the metrics. err is the error the attempt
// returns; a non-nil err sets the span's status to Error.
func (t *telemetry) end(ctx context.Context, r *record, err error) {
	attrs := metric.WithAttributes(OutcomeKey.String(string(r.outcome)), ActivityTypeKey.String(r.activityType))
	t.attempts.Add(ctx, 1, attrs)
	t.claim.Record(ctx, r.claimWait.Seconds(), attrs)
	if r.ranEffect {
		t.effect.Record(ctx, r.effectTime.Seconds(), attrs)
	}

	r.span.SetAttributes(OutcomeKey.String(string(r.outcome)), ClaimWaitKey.Float64(r.claimWait.Seconds()))
	if r.storedAttempt > 0 {
		r.span.SetAttributes(StoredAttemptKey.Int64(int64(r.storedAttempt)))
	}
	if err != nil {
		r.span.RecordError(err)
		r.span.SetStatus(codes.Error, string(r.outcome)+": "+err.Error())
	}
	r.span.End()
}
