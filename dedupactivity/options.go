package dedupactivity

import (
	"fmt"
	"regexp"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.temporal.io/sdk/converter"
)

// Defaults for Options fields left at their zero value.
const (
	// DefaultTable is the marker table's name.
	DefaultTable = "dedup_marker"
	// DefaultClaimWait bounds how long an attempt waits for another attempt
	// that holds the same event.
	DefaultClaimWait = 10 * time.Second
	// DefaultRetention is how long a marker is kept at least.
	DefaultRetention = 30 * 24 * time.Hour
	// DefaultMaxResultBytes is the largest encoded result stored: Temporal's
	// default payload size limit (2 MiB).
	DefaultMaxResultBytes = 2 << 20
	// MaxIdentityBytes is the largest encoded event identity accepted.
	MaxIdentityBytes = 64 << 10
)

// MismatchPolicy decides what a duplicate delivery with a different input
// does. The input is compared by fingerprint (see Options).
type MismatchPolicy int

const (
	// MismatchReject fails the attempt with a non-retryable ApplicationError
	// of type ErrTypePayloadMismatch wrapping ErrPayloadMismatch. The stored
	// effect is untouched. This is the default: a different payload under the
	// same identity is a bug (a non-deterministic input, or a business key
	// reused for another operation) that should surface.
	MismatchReject MismatchPolicy = iota
	// MismatchReturnStored treats the delivery as a duplicate: it returns
	// the first attempt's stored result. The span still records the outcome
	// payload_mismatch. (A delivery by another activity type than the one
	// that applied a run-scoped identity is ErrPayloadMismatch under either
	// policy: its stored result is of another type.)
	MismatchReturnStored
)

// String returns the policy's name.
func (p MismatchPolicy) String() string {
	switch p {
	case MismatchReject:
		return "reject"
	case MismatchReturnStored:
		return "return_stored"
	default:
		return fmt.Sprintf("MismatchPolicy(%d)", int(p))
	}
}

// Options configure a Deduper. The zero value is valid: every field has a
// documented default.
type Options struct {
	// Schema is the PostgreSQL schema holding the marker table. It must be a
	// plain lower-case identifier ([a-z_][a-z0-9_]*, at most 63 bytes), not
	// one of PostgreSQL's own (pg_ prefix). Migrate creates it if missing.
	//
	// Defaults to "": the table is unqualified and found through the
	// search_path of each statement. Set it when effects change search_path
	// in their transaction (SET LOCAL search_path, a schema per tenant):
	// without it, an attempt whose marker or result would go to another
	// schema's marker table fails with ErrSearchPathChanged, and nothing
	// commits.
	Schema string

	// Table is the marker table's name, a plain lower-case identifier
	// ([a-z_][a-z0-9_]*, at most 40 bytes so derived index names fit).
	// Give each independent user (or each test) its own table or schema:
	// markers in one table deduplicate against each other.
	//
	// Defaults to DefaultTable ("dedup_marker").
	Table string

	// DataConverter encodes the results stored for duplicates, and decodes
	// them. Use the same converter as the worker so a payload codec (for
	// example encryption) applies to stored results too. A context-aware
	// converter gets the activity's serialization context, as the SDK
	// gives it for the activity's result; outside an activity (Do,
	// ClaimTx, Deduper.Result), the context the identity gives: its
	// namespace, workflow ID and, for a business key, activity type. One
	// that implements converter.ContextAware (a key ID a context
	// propagator carries, as in Temporal's encryption sample) is then given
	// the call's context through WithContext, as the SDK gives it the
	// activity's.
	//
	// Defaults to converter.GetDefaultDataConverter().
	DataConverter converter.DataConverter

	// MismatchPolicy decides what a duplicate with a different input does.
	//
	// Defaults to MismatchReject.
	MismatchPolicy MismatchPolicy

	// ClaimWait bounds how long an attempt waits for another attempt whose
	// transaction holds the same event. After it, the attempt fails with a
	// retryable ErrClaimTimeout error and Temporal retries it later. The wait
	// is also cut short by the activity's own deadline and, as the claim
	// does not heartbeat while it waits, to 80% of the activity's
	// HeartbeatTimeout if it has one: Temporal would otherwise time the
	// attempt out first, and schedule the next, while this one still
	// waits. At most 24h.
	//
	// Defaults to DefaultClaimWait (10s).
	ClaimWait time.Duration

	// Retention is the least time a marker is kept. A marker is never
	// expired before its activity's ScheduleToClose bound (when the activity
	// has one), whichever is later. Set it above the longest time your
	// workflows may redeliver an activity. New refuses less than a minute.
	//
	// Defaults to DefaultRetention (30 days).
	Retention time.Duration

	// DiscardResults makes the Deduper store no results: a duplicate
	// delivery then returns the zero value of the activity's result type.
	// Use it when results hold data you do not want at rest in the marker
	// table.
	//
	// Defaults to false (results are stored).
	DiscardResults bool

	// MaxResultBytes is the largest encoded result stored, measured as
	// Temporal measures an activity's result against its payload size
	// limit (the Payloads the activity completes with). A larger result
	// fails the attempt (non-retryable) and rolls the effect back.
	//
	// Defaults to DefaultMaxResultBytes (2 MiB).
	MaxResultBytes int

	// PartitionInterval, when set, selects the partitioned layout: the
	// marker table is range-partitioned by the activity's ScheduledTime
	// (shared by every attempt of one scheduled activity) in partitions of
	// this width, made PartitionsAhead ahead by Migrate and Prune, and
	// expired partitions are dropped instead of deleted row by row. Choose
	// the layout when the table is created. Only run-scoped identities of
	// regular and standalone activities fit it (other deliveries do not
	// share a ScheduledTime): WithBusinessKey makes Wrap and Register panic
	// and Do fail, ClaimTx fails, and a local activity's delivery, or Do's
	// outside an activity, fails with a non-retryable invalid-usage error
	// (ErrInvalidOptions).
	//
	// Defaults to 0: one plain table.
	PartitionInterval time.Duration

	// PartitionsAhead is how many future partitions Migrate and Prune keep
	// ready in the partitioned layout. Prune at least twice within them:
	// EnsurePruneSchedule refuses an interval over half of PartitionsAhead
	// x PartitionInterval, which must be at most 100 years.
	//
	// Defaults to 3.
	PartitionsAhead int

	// TracerProvider creates the tracer for the span of every attempt.
	//
	// Defaults to otel.GetTracerProvider().
	TracerProvider trace.TracerProvider

	// MeterProvider creates the meter for the attempt counter and the
	// latency histograms.
	//
	// Defaults to otel.GetMeterProvider().
	MeterProvider metric.MeterProvider

	// TemporalMetrics also records the attempt counter, the latency
	// histograms and the pruned-markers counter through the activity's
	// activity.GetMetricsHandler(ctx): the MetricsHandler of the worker's
	// client.Options (Tally, Prometheus, ...), labelled by the SDK with
	// activity_type, namespace, task_queue and workflow_type. Names are
	// dedup_attempts (counter), dedup_claim_duration and
	// dedup_effect_duration (timers), labelled dedup_outcome and
	// error_type ("" when the attempt succeeded: every emission of a name
	// carries the same tag keys, which a Prometheus registry requires;
	// Prometheus stores the empty value as no label), and
	// dedup_marker_pruned (counter), labelled dedup_table. Calls of Do outside
	// an activity record through MeterProvider only. To record through the
	// SDK's handler only, set MeterProvider to noop.NewMeterProvider().
	//
	// It is for a handler that is not OpenTelemetry (Tally, say). Do not
	// set it when the worker's handler is the SDK's OpenTelemetry one
	// (go.temporal.io/sdk/contrib/opentelemetry) on this MeterProvider, or
	// on another exported to the same Prometheus: both paths then export
	// dedup_attempts_total, dedup_claim_duration_seconds,
	// dedup_effect_duration_seconds and dedup_marker_pruned_total, told
	// apart only by otel_scope_name, which doubles every count summed over
	// them and mixes two sets of histogram buckets. MeterProvider alone
	// already puts them beside the SDK's own metrics, with the labels they
	// join on.
	//
	// Defaults to false.
	TemporalMetrics bool
}

var identRE = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

// maxClaimWait bounds Options.ClaimWait well below the largest lock_timeout
// PostgreSQL accepts (about 24.8 days); a wait longer than an activity's
// StartToClose timeout serves no purpose anyway.
const maxClaimWait = 24 * time.Hour

// maxPartitionsSpan bounds PartitionsAhead x PartitionInterval.
const maxPartitionsSpan = 100 * 365 * 24 * time.Hour

// withDefaults returns a copy of o with zero fields set to their defaults.
func (o Options) withDefaults() Options {
	if o.Table == "" {
		o.Table = DefaultTable
	}
	if o.DataConverter == nil {
		o.DataConverter = converter.GetDefaultDataConverter()
	}
	if o.ClaimWait == 0 {
		o.ClaimWait = DefaultClaimWait
	}
	if o.Retention == 0 {
		o.Retention = DefaultRetention
	}
	if o.MaxResultBytes == 0 {
		o.MaxResultBytes = DefaultMaxResultBytes
	}
	if o.PartitionsAhead == 0 {
		o.PartitionsAhead = 3
	}
	if o.TracerProvider == nil {
		o.TracerProvider = otel.GetTracerProvider()
	}
	if o.MeterProvider == nil {
		o.MeterProvider = otel.GetMeterProvider()
	}
	return o
}

// validate checks o after withDefaults; its errors name the bad field.
func (o Options) validate() error {
	if o.Schema != "" && (len(o.Schema) > 63 || !identRE.MatchString(o.Schema)) {
		return fmt.Errorf("%w: Schema %q must match [a-z_][a-z0-9_]* and be at most 63 bytes", ErrInvalidOptions, o.Schema)
	}
	if strings.HasPrefix(o.Schema, "pg_") {
		// pg_temp above all: each session's own temporary schema, which
		// other connections do not see.
		return fmt.Errorf("%w: Schema %q: the pg_ prefix is PostgreSQL's (pg_catalog, pg_toast, pg_temp: a session's temporary schema, which other connections do not see)", ErrInvalidOptions, o.Schema)
	}
	if len(o.Table) > 40 || !identRE.MatchString(o.Table) {
		return fmt.Errorf("%w: Table %q must match [a-z_][a-z0-9_]* and be at most 40 bytes", ErrInvalidOptions, o.Table)
	}
	if o.MismatchPolicy != MismatchReject && o.MismatchPolicy != MismatchReturnStored {
		return fmt.Errorf("%w: MismatchPolicy %d is not a known policy", ErrInvalidOptions, int(o.MismatchPolicy))
	}
	if o.ClaimWait < time.Millisecond || o.ClaimWait > maxClaimWait {
		return fmt.Errorf("%w: ClaimWait must be between 1ms and %s, got %s", ErrInvalidOptions, maxClaimWait, o.ClaimWait)
	}
	if o.Retention < time.Minute {
		return fmt.Errorf("%w: Retention must be at least 1m, got %s", ErrInvalidOptions, o.Retention)
	}
	if o.PartitionInterval < 0 || (o.PartitionInterval > 0 && o.PartitionInterval < time.Second) || o.PartitionInterval%time.Second != 0 {
		// Whole seconds: partition bounds are read back to the second.
		return fmt.Errorf("%w: PartitionInterval must be 0 or a whole number of seconds, at least 1s, got %s", ErrInvalidOptions, o.PartitionInterval)
	}
	if o.PartitionsAhead < 1 {
		return fmt.Errorf("%w: PartitionsAhead must be at least 1, got %d", ErrInvalidOptions, o.PartitionsAhead)
	}
	if o.PartitionInterval > 0 && int64(o.PartitionsAhead) > int64(maxPartitionsSpan/o.PartitionInterval) {
		// The partitions ahead are made by time.Duration arithmetic, which
		// wraps past 292 years.
		return fmt.Errorf("%w: PartitionsAhead x PartitionInterval must be at most %s (100 years), got %d x %s", ErrInvalidOptions, maxPartitionsSpan, o.PartitionsAhead, o.PartitionInterval)
	}
	if o.MaxResultBytes < 0 {
		return fmt.Errorf("%w: MaxResultBytes must not be negative, got %d", ErrInvalidOptions, o.MaxResultBytes)
	}
	return nil
}
