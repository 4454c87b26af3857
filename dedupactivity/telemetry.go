package dedupactivity

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
)

// ScopeName is the instrumentation scope of this package's tracer and meter.
const ScopeName = "github.com/dedupactivity/dedupactivity/dedupactivity"

// Attribute keys. The Temporal IDs use the keys of the SDK's tracing
// interceptor (go.temporal.io/sdk/interceptor: temporalWorkflowID,
// temporalRunID, temporalActivityID), so one tag search in a trace backend
// finds the SDK's RunActivity spans and these together. Activity type,
// namespace and task queue use the labels of the SDK's own metrics
// (activity_type, namespace, task_queue) on spans and metrics alike, so a
// dashboard can join the two.
const (
	// OutcomeKey is the attempt's Outcome (claimed, duplicate, ...), on
	// spans and metrics (dedup_outcome in Prometheus).
	OutcomeKey = attribute.Key("dedup.outcome")
	// IdentityKindKey is the identity's Kind (activity, local_activity,
	// standalone, business_key).
	IdentityKindKey = attribute.Key("dedup.identity.kind")
	// IdentityHashKey is the hex SHA-256 of the identity encoding: the
	// marker's primary key. Raw identities (business keys in particular) are
	// not recorded, so no user data reaches the tracing backend.
	IdentityHashKey = attribute.Key("dedup.identity.hash")
	// ClaimWaitKey is the time, in seconds, spent claiming the event
	// (including waiting for another attempt that held it, and, when the
	// claim rode with the effect's first statement, that statement).
	ClaimWaitKey = attribute.Key("dedup.claim.wait")
	// StoredAttemptKey is, on a duplicate, the attempt number that applied
	// the effect.
	StoredAttemptKey = attribute.Key("dedup.stored.attempt")
	// PrepareStatementsKey is, on a PrepareEvent, how many statements the
	// claim prepared on its connection in that round trip.
	PrepareStatementsKey = attribute.Key("dedup.prepare.statements")
	// errorTypeKey is the OpenTelemetry semantic convention error.type, set
	// on spans and metrics of attempts that return an error (error_type in
	// Prometheus). Its value is, in this order: the ErrType* constant of
	// this package's error (DedupNotMigrated for ErrNotMigrated), the Type
	// of a Temporal ApplicationError the effect returned, the SQLSTATE of a
	// PostgreSQL error (but context.Canceled for a claim wait cut by the
	// cancel request of a cancelled context, whose SQLSTATE is
	// statement_timeout's), context.Canceled or context.DeadlineExceeded,
	// and otherwise _OTHER.
	errorTypeKey = attribute.Key("error.type")
	// activityTypeKey is the Temporal activity type: activity_type, the
	// label of the SDK's metrics.
	activityTypeKey = attribute.Key("activity_type")
	// namespaceKey is the Temporal namespace: namespace, the label of the
	// SDK's metrics.
	namespaceKey = attribute.Key("namespace")
	// taskQueueKey is the activity's task queue: task_queue, the label of
	// the SDK's metrics (empty outside an activity, in Do).
	taskQueueKey = attribute.Key("task_queue")
	// activityIDKey is the Temporal activity ID, as the SDK's tracing
	// interceptor tags it.
	activityIDKey = attribute.Key("temporalActivityID")
	// workflowIDKey is the workflow ID (empty for standalone activities),
	// as the SDK's tracing interceptor tags it.
	workflowIDKey = attribute.Key("temporalWorkflowID")
	// runIDKey is the workflow run ID (empty for standalone activities), as
	// the SDK's tracing interceptor tags it.
	runIDKey = attribute.Key("temporalRunID")
	// attemptKey is the Temporal attempt number (starts at 1; not monotonic
	// across activity resets).
	attemptKey = attribute.Key("temporal.activity.attempt")
	// dbSystemKey is the OpenTelemetry semantic convention db.system.name,
	// always "postgresql".
	dbSystemKey = attribute.Key("db.system.name")
)

// Metric names (OpenTelemetry). The Prometheus exporter writes them as
// dedup_attempts_total, dedup_claim_duration_seconds,
// dedup_effect_duration_seconds, dedup_marker_pruned_total,
// dedup_marker_oldest_age_seconds and dedup_marker_overdue_seconds. Through
// the SDK's metrics handler (Options.TemporalMetrics) the names have
// underscores for dots (dedup_attempts, ...) and the labels are
// dedup_outcome and error_type.
const (
	// MetricAttempts counts wrapped attempts by dedup.outcome,
	// activity_type, namespace, task_queue and (on errors) error.type. Unit
	// {attempt}. The first attempt of an activity type, namespace and task
	// queue makes the series of claimed, duplicate, payload_mismatch and
	// claim_timeout at zero, so that the next of each shows in PromQL's
	// increase() (that first attempt's own outcome, counted before any
	// collection, shows only from its second).
	MetricAttempts = "dedup.attempts"
	// MetricClaimDuration is the time spent claiming an event, in seconds,
	// with the attributes of MetricAttempts: from the attempt's start to the
	// claim's answer, which includes the effect's first statement when the
	// claim rode with it (see Round trips).
	MetricClaimDuration = "dedup.claim.duration"
	// MetricEffectDuration is the time the user's effect ran, in seconds,
	// with the attributes of MetricAttempts.
	MetricEffectDuration = "dedup.effect.duration"
	// MetricMarkersPruned counts markers deleted by Prune (rows deleted and
	// rows of dropped partitions), by dedup.table, from zero when New
	// returns. Unit {marker}.
	MetricMarkersPruned = "dedup.marker.pruned"
	// MetricOldestMarkerAge is, at each collection, the age in seconds of
	// the marker that expires first (by dedup.table): with one retention
	// for all activities that is the oldest marker. Above Retention plus
	// the prune interval, pruning is not keeping up. It is read by one
	// index-ordered query (ORDER BY expires_at LIMIT 1) per collection
	// (each scrape or export), bounded to 2s; no observation when the
	// table is empty or the query fails. In the partitioned layout it is
	// the age of the oldest range partition's start, or of the default
	// partition's first-expiring marker if older, read from the catalog
	// and the default partition's index: past Retention plus
	// PartitionInterval plus the prune interval, pruning is not keeping up.
	// A role that may not read the default partition (docs/design.md,
	// Security) gets the range partitions' bounds alone.
	MetricOldestMarkerAge = "dedup.marker.oldest_age"
	// MetricOverdueMarkerAge is, at each collection, how long in seconds
	// the marker that expires first has been expired (by dedup.table): 0
	// when no marker is expired, and, unlike MetricOldestMarkerAge,
	// observed for an empty table. Prune deletes expired markers, so with
	// a prune Schedule it stays below the prune interval plus a run's
	// time; growing, pruning stopped or fails, whatever Retention is. It
	// is read by the same query as MetricOldestMarkerAge, and not observed
	// when that query fails, so absent() sees a table the worker cannot
	// read. In the partitioned layout it is how long ago the default
	// partition's first marker expired or the oldest range partition's end
	// plus Retention passed, whichever is longer: a partition that holds a
	// marker expiring later (a late retry, a longer ScheduleToClose or
	// WithRetention) is kept until that marker expires, and counts as
	// overdue meanwhile.
	MetricOverdueMarkerAge = "dedup.marker.overdue"
)

// PrepareEvent is the span event of an attempt whose claim first prepared
// statements on its connection: once per connection for the claim's own,
// and for each new text of an effect's first statement that rides with the
// claim. That round trip is the attempt's, so the event explains a slower
// first attempt on a new connection. Its attribute is PrepareStatementsKey.
// A pgx Tracer that is a pgx.PrepareTracer (otelpgx) is told of each
// statement, as pgx tells it of its own.
const PrepareEvent = "dedup.prepare"

// TableKey is the marker table's name on the markers' metrics: Options.Table,
// or schema.table when Options.Schema is set.
const TableKey = attribute.Key("dedup.table")

// Outcome is what one attempt did.
type Outcome string

// Outcomes, recorded in the OutcomeKey span attribute and the MetricAttempts
// counter.
const (
	// OutcomeClaimed: this attempt claimed the event and committed its effect.
	// Through ClaimTx it is counted when the claim is made, in a transaction
	// the caller commits or rolls back: a caller that rolls back and claims
	// again counts it again.
	OutcomeClaimed Outcome = "claimed"
	// OutcomeDuplicate: the event was already applied; nothing ran, the
	// stored result was returned.
	OutcomeDuplicate Outcome = "duplicate"
	// OutcomePayloadMismatch: the event was already applied with a different
	// input (rejected, or returned the stored result under
	// MismatchReturnStored), or by another activity type (rejected).
	OutcomePayloadMismatch Outcome = "payload_mismatch"
	// OutcomeEffectError: the effect returned an error, panicked or ended
	// its goroutine (runtime.Goexit); all was rolled back.
	OutcomeEffectError Outcome = "effect_error"
	// OutcomeClaimTimeout: another attempt held the event past ClaimWait.
	OutcomeClaimTimeout Outcome = "claim_timeout"
	// OutcomeError: an infrastructure or usage error (database, encoding,
	// invalid input), or a panic outside the effect (the library's, or the
	// DataConverter's on the effect's result); all was rolled back.
	OutcomeError Outcome = "error"
)

// Names and labels of the metrics recorded through the SDK's metrics handler
// (Options.TemporalMetrics). The handler is the activity's, already labelled
// by the SDK with activity_type, namespace, task_queue and workflow_type.
const (
	sdkMetricAttempts       = "dedup_attempts"
	sdkMetricClaimDuration  = "dedup_claim_duration"
	sdkMetricEffectDuration = "dedup_effect_duration"
	sdkMetricMarkersPruned  = "dedup_marker_pruned"
	sdkOutcomeTag           = "dedup_outcome"
	sdkErrorTypeTag         = "error_type"
	sdkTableTag             = "dedup_table"
)

type telemetry struct {
	tracer trace.Tracer
	// kindInternal is trace.WithSpanKind(trace.SpanKindInternal), made
	// once: each call of WithSpanKind allocates.
	kindInternal trace.SpanStartOption
	meter        metric.Meter
	attempts     metric.Int64Counter
	claim        metric.Float64Histogram
	effect       metric.Float64Histogram
	pruned       metric.Int64Counter
	// sdkMetrics also records through activity.GetMetricsHandler.
	sdkMetrics bool
	table      string

	// sets caches the metric attribute sets of attempts that end without
	// an error, so an attempt does not sort and hash them again; the
	// cache stops growing at maxCachedSets.
	setsMu sync.RWMutex
	sets   map[setKey]measureOpts

	// zeroOutcomes are the outcomes, with their error types, whose
	// MetricAttempts series an attempt of a new label combination makes
	// at zero (see seedAttempts).
	zeroOutcomes []outcomeType
	// seeded holds the label combinations whose zeroOutcomes series are
	// made; it stops growing at maxSeeded.
	seededMu sync.RWMutex
	seeded   map[seedKey]struct{}
}

// outcomeType is an outcome and the error.type it comes with ("" for none).
type outcomeType struct {
	outcome Outcome
	errType string
}

// seedKey is a label combination of MetricAttempts known only when an
// attempt of it runs. sdk tells the SDK handler's series (whose handler
// adds workflow_type) from the MeterProvider's.
type seedKey struct {
	activityType, namespace, taskQueue, workflowType string
	sdk                                              bool
}

// maxSeeded bounds telemetry.seeded, the activity types x namespaces x
// task queues (x workflow types, through the SDK's handler) whose series
// are made at zero: at most 5 x 128 zero series per instrument, a third
// of the OpenTelemetry SDK's default cardinality limit (2000), past which
// real attempts would be counted in the overflow series, without their
// labels. Past it, a new combination's series appear with their first
// attempt.
const maxSeeded = 128

// measureOpts is one attribute set as the option lists of the instruments'
// calls, so a call with a cached set allocates no variadic slice.
type measureOpts struct {
	add    []metric.AddOption
	record []metric.RecordOption
}

func newMeasureOpts(set attribute.Set) measureOpts {
	o := metric.WithAttributeSet(set)
	return measureOpts{add: []metric.AddOption{o}, record: []metric.RecordOption{o}}
}

// setKey is the attributes of an attempt's metrics that ended without an
// error.
type setKey struct {
	outcome                            Outcome
	activityType, namespace, taskQueue string
}

// maxCachedSets bounds telemetry.sets: outcomes x activity types x
// namespaces x task queues of one worker stay far below it.
const maxCachedSets = 4096

// zeroOutcomesFor lists the outcomes, with their error types, whose series
// are made at zero: those the dashboard and the alert rules read (claimed,
// duplicate, payload_mismatch, claim_timeout), not every error type, so
// that a worker's zero series stay well below OpenTelemetry's default limit
// of 2000 series per instrument (see maxSeeded). The rejected mismatch is
// made under every policy: a run-scoped identity delivered by another
// activity type is rejected under MismatchReturnStored too.
func zeroOutcomesFor(policy MismatchPolicy) []outcomeType {
	zero := []outcomeType{{OutcomeClaimed, ""}, {OutcomeDuplicate, ""}, {OutcomePayloadMismatch, errorTypeOf(ErrPayloadMismatch)}, {OutcomeClaimTimeout, errorTypeOf(ErrClaimTimeout)}}
	if policy == MismatchReturnStored {
		zero = append(zero, outcomeType{OutcomePayloadMismatch, ""})
	}
	return zero
}

// errorTypeOf is the error.type of this package's sentinel (errorClasses).
func errorTypeOf(sentinel error) string {
	for _, c := range errorClasses {
		if c.sentinel == sentinel {
			return c.typ
		}
	}
	return ""
}

// newTelemetry makes the instruments, and the pruned counter's series of
// table at zero: a counter series that first appears at 1 shows no increase
// in PromQL's increase() and rate(), which need an earlier sample, so the
// first prune (or first anything) would never show.
func newTelemetry(tp trace.TracerProvider, mp metric.MeterProvider, sdkMetrics bool, table string, policy MismatchPolicy) (*telemetry, error) {
	meter := mp.Meter(ScopeName)
	t := &telemetry{tracer: tp.Tracer(ScopeName), kindInternal: trace.WithSpanKind(trace.SpanKindInternal),
		meter: meter, sdkMetrics: sdkMetrics, table: table, sets: make(map[setKey]measureOpts),
		zeroOutcomes: zeroOutcomesFor(policy), seeded: make(map[seedKey]struct{})}
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
	if t.pruned, err = meter.Int64Counter(MetricMarkersPruned,
		metric.WithDescription("Expired markers deleted by Prune."),
		metric.WithUnit("{marker}")); err != nil {
		return nil, fmt.Errorf("create %s: %w", MetricMarkersPruned, err)
	}
	t.pruned.Add(context.Background(), 0, metric.WithAttributes(TableKey.String(table)))
	return t, nil
}

// observeMarkers registers the MetricOldestMarkerAge and
// MetricOverdueMarkerAge gauges, read from d's table at each collection.
func (t *telemetry) observeMarkers(d *Deduper) error {
	attrs := metric.WithAttributes(TableKey.String(t.table))
	oldest, err := t.meter.Float64ObservableGauge(MetricOldestMarkerAge,
		metric.WithDescription("Age of the marker that expires first (the oldest, with one retention); read by an index-ordered query at each collection."),
		metric.WithUnit("s"))
	if err != nil {
		return fmt.Errorf("create %s: %w", MetricOldestMarkerAge, err)
	}
	overdue, err := t.meter.Float64ObservableGauge(MetricOverdueMarkerAge,
		metric.WithDescription("How long the marker that expires first has been expired, waiting for Prune (0 when none has); read with the oldest marker's age."),
		metric.WithUnit("s"))
	if err != nil {
		return fmt.Errorf("create %s: %w", MetricOverdueMarkerAge, err)
	}
	// Registered apart from the instruments: a second Deduper on the same
	// MeterProvider gets the same instruments, and the SDK ignores (with a
	// warning) callbacks given when an instrument is made again.
	var rangesOnly atomic.Bool // the partitioned layout's default partition may not be read
	partitioned := d.store.oldestRanges != ""
	read := func(ctx context.Context, query string) (age *float64, late float64, err error) {
		if !partitioned {
			err = d.pool.QueryRow(ctx, query).Scan(&age, &late)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil, 0, nil // an empty table: nothing is overdue
			}
			return age, late, err
		}
		return age, late, d.inISODateStyle(ctx, func(tx pgx.Tx) error { return tx.QueryRow(ctx, query).Scan(&age, &late) })
	}
	_, err = t.meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		query := d.store.oldest
		if rangesOnly.Load() {
			query = d.store.oldestRanges
		}
		age, late, err := read(ctx, query)
		if sqlState(err) == stateInsufficientPrivilege && partitioned && !rangesOnly.Load() {
			// A role granted the marker table and not its default
			// partition (as in docs/design.md's Security): from now on
			// the range partitions' bounds alone, so that no scrape
			// logs the same ERROR.
			rangesOnly.Store(true)
			age, late, err = read(ctx, d.store.oldestRanges)
		}
		if err != nil {
			return nil // the database is unreachable, or the table cannot be read: no observation
		}
		if age != nil {
			o.ObserveFloat64(oldest, *age, attrs)
		}
		o.ObserveFloat64(overdue, late, attrs)
		return nil
	}, oldest, overdue)
	if err != nil {
		return fmt.Errorf("observe %s and %s: %w", MetricOldestMarkerAge, MetricOverdueMarkerAge, err)
	}
	return nil
}

// markersPruned records n markers pruned. The MeterProvider's series is
// made at zero by newTelemetry; the SDK handler's, which only an activity
// has, by the first prune activity, whatever it deletes.
func (t *telemetry) markersPruned(ctx context.Context, n int64) {
	if n > 0 {
		t.pruned.Add(ctx, n, metric.WithAttributes(TableKey.String(t.table)))
	}
	if t.sdkMetrics && activity.IsActivity(ctx) {
		activity.GetMetricsHandler(ctx).WithTags(map[string]string{sdkTableTag: t.table}).Counter(sdkMetricMarkersPruned).Inc(n)
	}
}

// record is the telemetry of one attempt, filled while it runs.
type record struct {
	span          trace.Span
	activityType  string
	namespace     string
	taskQueue     string
	sdk           client.MetricsHandler // nil unless Options.TemporalMetrics and an activity
	workflowType  string                // set with sdk: the SDK's handler is labelled with it
	outcome       Outcome
	claimWait     time.Duration
	effectTime    time.Duration
	ranEffect     bool
	noClaim       bool // the attempt failed before its claim: no claim duration
	storedAttempt int32
}

// set copies what the claim returned into the record.
func (r *record) set(a attempt) {
	r.outcome, r.claimWait, r.effectTime, r.ranEffect, r.storedAttempt = a.outcome, a.claimWait, a.effectTime, a.ranEffect, a.storedAttempt
}

// start starts the telemetry of an attempt of id, whose marker's primary
// key is hash.
func (t *telemetry) start(ctx context.Context, info activity.Info, id Identity, hash [32]byte) (context.Context, *record) {
	return t.startSpan(ctx, info, id, hash[:])
}

// failed records an attempt that failed before it could claim (the business
// key function's error, an identity newMarker refuses, a delivery the
// partitioned layout refuses): a span, and MetricAttempts under
// OutcomeError with err's error.type. Having claimed nothing, it records no
// claim duration. hash is nil when the attempt had no valid identity.
//
// A refused identity (Do's, outside an activity) may hold names and IDs of
// any length and any bytes: they are cut to maxLabelBytes of valid UTF-8
// for the span and the metric's labels (an exporter's protobuf encoding
// fails a batch on invalid UTF-8).
func (t *telemetry) failed(ctx context.Context, info activity.Info, id Identity, hash []byte, err error) {
	info.ActivityType.Name, info.Namespace, id.Namespace = label(info.ActivityType.Name), label(info.Namespace), label(id.Namespace)
	info.WorkflowExecution.ID, info.WorkflowExecution.RunID = label(info.WorkflowExecution.ID), label(info.WorkflowExecution.RunID)
	info.ActivityID, info.ActivityRunID = label(info.ActivityID), label(info.ActivityRunID)
	ctx, r := t.startSpan(ctx, info, id, hash)
	r.outcome, r.noClaim = OutcomeError, true
	t.end(ctx, r, err)
}

// maxLabelBytes bounds a label value that failed takes from a refused
// identity.
const maxLabelBytes = 128

// label is s as valid UTF-8 (U+FFFD for each run of bad bytes) of at most
// maxLabelBytes, cut at a rune boundary.
func label(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) <= maxLabelBytes {
		return s
	}
	cut := maxLabelBytes
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

// startSpan is start with the hash as a slice; nil leaves IdentityHashKey
// out.
func (t *telemetry) startSpan(ctx context.Context, info activity.Info, id Identity, hash []byte) (context.Context, *record) {
	r := &record{activityType: info.ActivityType.Name, namespace: cmp.Or(info.Namespace, id.Namespace), taskQueue: info.TaskQueue}
	if t.sdkMetrics && activity.IsActivity(ctx) {
		r.sdk = activity.GetMetricsHandler(ctx)
		if info.WorkflowType != nil {
			r.workflowType = info.WorkflowType.Name
		}
	}
	attrs := make([]attribute.KeyValue, 0, 10)
	attrs = append(attrs,
		dbSystemKey.String("postgresql"),
		activityTypeKey.String(r.activityType),
		namespaceKey.String(r.namespace),
		taskQueueKey.String(r.taskQueue),
		activityIDKey.String(info.ActivityID),
		attemptKey.Int64(int64(info.Attempt)),
		workflowIDKey.String(info.WorkflowExecution.ID),
		runIDKey.String(info.WorkflowExecution.RunID),
		IdentityKindKey.String(id.Kind.String()),
	)
	if hash != nil {
		var hashHex [2 * sha256.Size]byte
		hex.Encode(hashHex[:], hash)
		attrs = append(attrs, IdentityHashKey.String(string(hashHex[:])))
	}
	ctx, r.span = t.tracer.Start(ctx, "Dedup:"+info.ActivityType.Name, t.kindInternal, trace.WithAttributes(attrs...))
	return ctx, r
}

// end closes the span and records the metrics. err is the error the attempt
// returns; a non-nil err sets the span's status to Error and error.type.
func (t *telemetry) end(ctx context.Context, r *record, err error) {
	var errType string
	if err != nil {
		errType = errorType(err)
	}
	o := t.metricAttrs(r, errType)
	t.attempts.Add(ctx, 1, o.add...)
	if !r.noClaim {
		t.claim.Record(ctx, r.claimWait.Seconds(), o.record...)
	}
	if r.ranEffect {
		t.effect.Record(ctx, r.effectTime.Seconds(), o.record...)
	}
	if r.sdk != nil {
		t.seedSDKAttempts(r)
		h := r.sdk.WithTags(t.sdkTags(r, r.outcome, errType))
		h.Counter(sdkMetricAttempts).Inc(1)
		if !r.noClaim {
			h.Timer(sdkMetricClaimDuration).Record(r.claimWait)
		}
		if r.ranEffect {
			h.Timer(sdkMetricEffectDuration).Record(r.effectTime)
		}
	}

	// A span that is not recorded (not sampled, or no TracerProvider) is
	// given no attributes: building them is most of what it would cost.
	if !r.span.IsRecording() {
		r.span.End()
		return
	}
	r.span.SetAttributes(OutcomeKey.String(string(r.outcome)), ClaimWaitKey.Float64(r.claimWait.Seconds()))
	if r.storedAttempt > 0 {
		r.span.SetAttributes(StoredAttemptKey.Int64(int64(r.storedAttempt)))
	}
	if err != nil {
		r.span.SetAttributes(errorTypeKey.String(errType))
		r.span.RecordError(err)
		r.span.SetStatus(codes.Error, string(r.outcome)+": "+err.Error())
	}
	r.span.End()
}

// sdkTags are the tags of an attempt's metrics through the SDK's handler.
// error_type is set on every attempt, "" when it succeeded: a Prometheus
// registry (Tally's reporter, say) takes one set of label names per metric
// name and refuses a second, and Prometheus stores an empty label as no
// label.
func (t *telemetry) sdkTags(r *record, outcome Outcome, errType string) map[string]string {
	return map[string]string{
		sdkOutcomeTag:           string(outcome),
		string(activityTypeKey): r.activityType,
		string(namespaceKey):    r.namespace,
		string(taskQueueKey):    r.taskQueue,
		sdkErrorTypeTag:         errType,
	}
}

// metricAttrs returns the attributes of an attempt's metrics: outcome,
// activity type, namespace, task queue and, when it failed, error.type.
// An attempt whose set is not cached (its combination's first of that
// outcome, or a failure) also makes the combination's zeroOutcomes series
// (seedAttempts); a cached one has had them made.
func (t *telemetry) metricAttrs(r *record, errType string) measureOpts {
	k := setKey{r.outcome, r.activityType, r.namespace, r.taskQueue}
	full := true
	if errType == "" {
		t.setsMu.RLock()
		o, ok := t.sets[k]
		full = len(t.sets) >= maxCachedSets
		t.setsMu.RUnlock()
		if ok {
			return o
		}
	}
	t.seedAttempts(r)
	o := newMeasureOpts(attribute.NewSet(attemptAttrs(r.outcome, r.activityType, r.namespace, r.taskQueue, errType)...))
	if errType != "" {
		return o // error types are not cached
	}
	if !full {
		t.setsMu.Lock()
		if len(t.sets) < maxCachedSets {
			t.sets[k] = o
		}
		t.setsMu.Unlock()
	}
	return o
}

// attemptAttrs are the attributes of MetricAttempts and the histograms:
// error.type only when errType is not "".
func attemptAttrs(outcome Outcome, activityType, namespace, taskQueue, errType string) []attribute.KeyValue {
	kv := []attribute.KeyValue{
		OutcomeKey.String(string(outcome)),
		activityTypeKey.String(activityType),
		namespaceKey.String(namespace),
		taskQueueKey.String(taskQueue),
	}
	if errType != "" {
		kv = append(kv, errorTypeKey.String(errType))
	}
	return kv
}

// firstSeen says whether k is new, and records it unless maxSeeded
// combinations are recorded already (then it says false).
func (t *telemetry) firstSeen(k seedKey) bool {
	t.seededMu.RLock()
	_, ok := t.seeded[k]
	full := len(t.seeded) >= maxSeeded
	t.seededMu.RUnlock()
	if ok || full {
		return false
	}
	t.seededMu.Lock()
	defer t.seededMu.Unlock()
	if _, ok := t.seeded[k]; ok || len(t.seeded) >= maxSeeded {
		return false
	}
	t.seeded[k] = struct{}{}
	return true
}

// seedAttempts makes the MetricAttempts series of zeroOutcomes at zero for
// r's activity type, namespace and task queue, the first time an attempt of
// them ends. A counter series that first appears at 1 shows no increase in
// PromQL's increase() and rate(), which need an earlier sample: without
// these, the first payload mismatch or claim timeout of an activity type
// would never show on a dashboard or in an alert. Its histograms are left
// alone (an observation cannot be zero).
func (t *telemetry) seedAttempts(r *record) {
	if !t.firstSeen(seedKey{activityType: r.activityType, namespace: r.namespace, taskQueue: r.taskQueue}) {
		return
	}
	ctx := context.Background() // not the attempt's: a zero has no exemplar
	for _, z := range t.zeroOutcomes {
		t.attempts.Add(ctx, 0, metric.WithAttributeSet(attribute.NewSet(attemptAttrs(z.outcome, r.activityType, r.namespace, r.taskQueue, z.errType)...)))
	}
}

// seedSDKAttempts is seedAttempts for the SDK handler's dedup_attempts,
// whose series also carry the workflow type.
func (t *telemetry) seedSDKAttempts(r *record) {
	if !t.firstSeen(seedKey{activityType: r.activityType, namespace: r.namespace, taskQueue: r.taskQueue, workflowType: r.workflowType, sdk: true}) {
		return
	}
	for _, z := range t.zeroOutcomes {
		r.sdk.WithTags(t.sdkTags(r, z.outcome, z.errType)).Counter(sdkMetricAttempts).Inc(0)
	}
}

// errorType is the error.type of err (see errorTypeKey).
func errorType(err error) string {
	if c, ok := classify(err); ok {
		return c.typ
	}
	var appErr *temporal.ApplicationError
	if errors.As(err, &appErr) && appErr.Type() != "" {
		return appErr.Type()
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		if pgErr.Code == stateQueryCanceled && errors.Is(err, context.Canceled) {
			return "context.Canceled" // pgx's cancel request for a cancelled context (claimError), not statement_timeout
		}
		return pgErr.Code
	}
	switch {
	case errors.Is(err, context.Canceled):
		return "context.Canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "context.DeadlineExceeded"
	}
	return "_OTHER"
}
