package outbox

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of this package's tracer and meter.
const ScopeName = "github.com/dedupactivity/dedupactivity/dedupactivity/outbox"

// Attribute keys of this package's spans and metrics.
const (
	// DestinationKey is the message's destination.
	DestinationKey = attribute.Key("dedup.outbox.destination")
	// ResultKey is what a send came to: delivered, retried, dead,
	// lease_lost or stopped (the pass stopped at it: the relay stopping,
	// or its outcome could not be recorded, the message left leased).
	ResultKey = attribute.Key("dedup.outbox.result")
	// MessageKeyKey is the message's idempotency key.
	MessageKeyKey = attribute.Key("dedup.outbox.idempotency_key")
	// MessageNameKey is the message's name.
	MessageNameKey = attribute.Key("dedup.outbox.name")
	// AttemptKey is the message's send count, this send included.
	AttemptKey = attribute.Key("dedup.outbox.attempt")
	// ReconcileActionKey is what the reconciler did with a message:
	// applied, requeued, rejected or unresolved.
	ReconcileActionKey = attribute.Key("dedup.outbox.reconcile.action")
	// StateKey is a message state (State) in MetricMessages.
	StateKey = attribute.Key("dedup.outbox.state")
	// TableKey is the outbox table's name on MetricMessages and
	// MetricOldestPendingAge: Options.Table, or schema.table when
	// Options.Schema is set.
	TableKey = attribute.Key("dedup.outbox.table")
)

// Metric names.
const (
	// MetricDeliveries counts sends by dedup.outbox.result and
	// dedup.outbox.destination. Unit {message}. The series of every result
	// start at zero: for RelayConfig.Destinations when the Relay is made,
	// for another destination at its first send.
	MetricDeliveries = "dedup.outbox.deliveries"
	// MetricOldestPendingAge is, at each collection, the age in seconds of
	// the oldest message not yet delivered (pending or sending), by
	// dedup.outbox.table; 0 when none waits. Growing: the relay is not
	// running, falls behind, or a destination keeps failing.
	MetricOldestPendingAge = "dedup.outbox.oldest_pending_age"
	// MetricMessages is, at each collection, the number of messages that
	// wait for the relay (pending, sending) or for the reconciler or a
	// person (dead), by dedup.outbox.state and dedup.outbox.table. Unit
	// {message}.
	//
	// Both gauges are registered by New (Options.MeterProvider) and read by
	// one query over the waiting states' partial indexes, bounded to 2s; a
	// failed query observes nothing, so a stale value is never exported.
	MetricMessages = "dedup.outbox.messages"
	// MetricReconciled counts messages the reconciler settled or reported,
	// by dedup.outbox.reconcile.action and dedup.outbox.destination. The
	// series of every action start at zero: for
	// ReconcilerConfig.Destinations when the Reconciler is made, for another
	// destination when a Reconcile first settles or reports a message of
	// it.
	MetricReconciled = "dedup.outbox.reconciled"
)

// Send results, recorded in ResultKey.
const (
	resultDelivered = "delivered"
	resultRetried   = "retried"
	resultDead      = "dead"
	resultLeaseLost = "lease_lost"
	resultStopped   = "stopped"
)

// Reconciler actions, recorded in ReconcileActionKey.
const (
	actionApplied    = "applied"
	actionRequeued   = "requeued"
	actionRejected   = "rejected"
	actionUnresolved = "unresolved"
)

// maxZeroDestinations bounds the destinations whose series one zeroSeries
// makes: at most 5 x 64 zero series per instrument, well below the
// OpenTelemetry SDK's default cardinality limit (2000), past which real
// counts would go to the overflow series without their labels.
const maxZeroDestinations = 64

// zeroSeries makes a counter's series at zero for each value of one key
// (the results, the actions) with each destination, once per destination.
// PromQL's increase() and rate() see no increase in a counter series that
// first appears at 1: without it, the first dead letter or rejection of a
// destination would never show on a dashboard or in an alert. It is safe for
// concurrent use.
type zeroSeries struct {
	counter metric.Int64Counter
	key     attribute.Key
	values  []string

	mu   sync.RWMutex
	made map[string]struct{} // destinations
}

func newZeroSeries(counter metric.Int64Counter, key attribute.Key, values ...string) *zeroSeries {
	return &zeroSeries{counter: counter, key: key, values: values, made: map[string]struct{}{}}
}

// destination makes dest's series, unless they are made or
// maxZeroDestinations destinations have theirs.
func (z *zeroSeries) destination(dest string) {
	z.mu.RLock()
	_, ok := z.made[dest]
	full := len(z.made) >= maxZeroDestinations
	z.mu.RUnlock()
	if ok || full {
		return
	}
	z.mu.Lock()
	if _, ok := z.made[dest]; ok || len(z.made) >= maxZeroDestinations {
		z.mu.Unlock()
		return
	}
	z.made[dest] = struct{}{}
	z.mu.Unlock()
	for _, v := range z.values {
		z.counter.Add(context.Background(), 0, metric.WithAttributes(z.key.String(v), DestinationKey.String(dest)))
	}
}

type relayTelemetry struct {
	tracer     trace.Tracer
	deliveries metric.Int64Counter
	zero       *zeroSeries
}

// newRelayTelemetry makes the relay's instruments, and the MetricDeliveries
// series of destinations at zero.
func newRelayTelemetry(tp trace.TracerProvider, mp metric.MeterProvider, destinations []string) (*relayTelemetry, error) {
	meter := mp.Meter(ScopeName)
	t := &relayTelemetry{tracer: tp.Tracer(ScopeName)}
	var err error
	if t.deliveries, err = meter.Int64Counter(MetricDeliveries,
		metric.WithDescription("Outbox sends by result and destination."), metric.WithUnit("{message}")); err != nil {
		return nil, fmt.Errorf("outbox: create %s: %w", MetricDeliveries, err)
	}
	t.zero = newZeroSeries(t.deliveries, ResultKey, resultDelivered, resultRetried, resultDead, resultLeaseLost, resultStopped)
	for _, d := range destinations {
		t.zero.destination(d)
	}
	return t, nil
}

// observeBacklog registers MetricOldestPendingAge and MetricMessages, read
// from ob's table at each collection.
func observeBacklog(meter metric.Meter, ob *Outbox) error {
	oldest, err := meter.Float64ObservableGauge(MetricOldestPendingAge,
		metric.WithDescription("Age of the oldest outbox message not yet delivered; read at each collection."), metric.WithUnit("s"))
	if err != nil {
		return fmt.Errorf("outbox: create %s: %w", MetricOldestPendingAge, err)
	}
	messages, err := meter.Int64ObservableGauge(MetricMessages,
		metric.WithDescription("Outbox messages waiting for the relay (pending, sending) or for the reconciler or a person (dead), by state; read at each collection."),
		metric.WithUnit("{message}"))
	if err != nil {
		return fmt.Errorf("outbox: create %s: %w", MetricMessages, err)
	}
	table := TableKey.String(ob.name)
	attrs := func(state State) metric.ObserveOption {
		return metric.WithAttributes(table, StateKey.String(string(state)))
	}
	pending, sending, dead := attrs(StatePending), attrs(StateSending), attrs(StateDead)
	_, err = meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		b, err := ob.backlog(ctx)
		if err != nil {
			return nil // the database is unreachable: no observation
		}
		o.ObserveFloat64(oldest, b.oldestPendingAge, metric.WithAttributes(table))
		o.ObserveInt64(messages, b.pending, pending)
		o.ObserveInt64(messages, b.sending, sending)
		o.ObserveInt64(messages, b.dead, dead)
		return nil
	}, oldest, messages)
	if err != nil {
		return fmt.Errorf("outbox: register the backlog gauges: %w", err)
	}
	return nil
}

func (t *relayTelemetry) startSend(ctx context.Context, d Delivery) (context.Context, trace.Span) {
	return t.tracer.Start(ctx, "OutboxSend:"+d.Destination, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(DestinationKey.String(d.Destination), MessageKeyKey.String(d.Key),
			MessageNameKey.String(d.Name), AttemptKey.Int(d.Attempt)))
}

func (t *relayTelemetry) endSend(ctx context.Context, span trace.Span, d Delivery, result string, err error) {
	t.zero.destination(d.Destination) // a destination not known up front: from its first send on
	t.deliveries.Add(ctx, 1, metric.WithAttributes(ResultKey.String(result), DestinationKey.String(d.Destination)))
	span.SetAttributes(ResultKey.String(result))
	if err != nil {
		span.RecordError(err)
		if result != resultRetried {
			span.SetStatus(codes.Error, result+": "+err.Error())
		}
	}
	span.End()
}

// errorText is err's message as last_error stores it: at most 2000 bytes,
// storable as text.
func errorText(err error) string {
	msg := err.Error()
	if len(msg) > 2000 {
		msg = msg[:2000]
	}
	return validText(msg)
}

// validText makes s storable as text: invalid UTF-8 and NUL become U+FFFD.
func validText(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}
