package outbox

import (
	"context"
	"fmt"
	"strings"

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
	// lease_lost or stopped.
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
)

// Metric names.
const (
	// MetricDeliveries counts sends by dedup.outbox.result and
	// dedup.outbox.destination. Unit {message}.
	MetricDeliveries = "dedup.outbox.deliveries"
	// MetricOldestPendingAge is the age, in seconds, of the oldest message
	// not yet delivered (pending or sending), recorded after every relay
	// pass.
	MetricOldestPendingAge = "dedup.outbox.oldest_pending_age"
	// MetricMessages is the number of messages in each state that waits
	// for the relay (pending, sending) or for a person or the reconciler
	// (dead, rejected), by dedup.outbox.state, recorded after every relay
	// pass. Unit {message}.
	MetricMessages = "dedup.outbox.messages"
	// MetricReconciled counts messages the reconciler settled or reported,
	// by dedup.outbox.reconcile.action and dedup.outbox.destination.
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

type relayTelemetry struct {
	tracer     trace.Tracer
	deliveries metric.Int64Counter
	oldest     metric.Float64Gauge
	messages   metric.Int64Gauge
}

func newRelayTelemetry(tp trace.TracerProvider, mp metric.MeterProvider) (*relayTelemetry, error) {
	meter := mp.Meter(ScopeName)
	t := &relayTelemetry{tracer: tp.Tracer(ScopeName)}
	var err error
	if t.deliveries, err = meter.Int64Counter(MetricDeliveries,
		metric.WithDescription("Outbox sends by result and destination."), metric.WithUnit("{message}")); err != nil {
		return nil, fmt.Errorf("outbox: create %s: %w", MetricDeliveries, err)
	}
	if t.oldest, err = meter.Float64Gauge(MetricOldestPendingAge,
		metric.WithDescription("Age of the oldest outbox message not yet delivered."), metric.WithUnit("s")); err != nil {
		return nil, fmt.Errorf("outbox: create %s: %w", MetricOldestPendingAge, err)
	}
	if t.messages, err = meter.Int64Gauge(MetricMessages,
		metric.WithDescription("Outbox messages waiting for the relay (pending, sending) or for a person or the reconciler (dead, rejected), by state."),
		metric.WithUnit("{message}")); err != nil {
		return nil, fmt.Errorf("outbox: create %s: %w", MetricMessages, err)
	}
	return t, nil
}

func (t *relayTelemetry) startSend(ctx context.Context, d Delivery) (context.Context, trace.Span) {
	return t.tracer.Start(ctx, "OutboxSend:"+d.Destination, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(DestinationKey.String(d.Destination), MessageKeyKey.String(d.Key),
			MessageNameKey.String(d.Name), AttemptKey.Int(d.Attempt)))
}

func (t *relayTelemetry) endSend(ctx context.Context, span trace.Span, d Delivery, result string, err error) {
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
