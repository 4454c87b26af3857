package dedupactivity

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	"go.temporal.io/sdk/activity"
	temporalotel "go.temporal.io/sdk/contrib/opentelemetry"
)

// TestMetricAttrsCache counts attempts of two activity types, each twice
// (the second from the cache of attribute sets), and a failed one, whose
// error.type is never cached, on the counter and both histograms; the cache
// stops growing at maxCachedSets.
func TestMetricAttrsCache(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	tel, err := newTelemetry(tracenoop.NewTracerProvider(), sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)), false, "t", MismatchReject)
	require.NoError(t, err)
	ctx := context.Background()
	end := func(activityType string, outcome Outcome, err error) {
		_, span := tel.tracer.Start(ctx, "x")
		tel.end(ctx, &record{span: span, activityType: activityType, namespace: "ns", taskQueue: "q", outcome: outcome, ranEffect: true}, err)
	}
	for range 2 {
		end("A", OutcomeClaimed, nil)
		end("B", OutcomeClaimed, nil)
		end("A", OutcomeDuplicate, nil)
	}
	end("A", OutcomeClaimed, errors.New("lost"))

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	got := map[string]map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			add := func(attrs attribute.Set, n int64) {
				get := func(k attribute.Key) string { v, _ := attrs.Value(k); return v.AsString() }
				if got[m.Name] == nil {
					got[m.Name] = map[string]int64{}
				}
				got[m.Name][get(activityTypeKey)+"/"+get(OutcomeKey)+"/"+get(errorTypeKey)] += n
			}
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range d.DataPoints {
					if dp.Value != 0 { // not the series made at zero
						add(dp.Attributes, dp.Value)
					}
				}
			case metricdata.Histogram[float64]:
				for _, dp := range d.DataPoints {
					add(dp.Attributes, int64(dp.Count))
				}
			}
		}
	}
	want := map[string]int64{"A/claimed/": 2, "B/claimed/": 2, "A/duplicate/": 2, "A/claimed/_OTHER": 1}
	require.Equal(t, map[string]map[string]int64{MetricAttempts: want, MetricClaimDuration: want, MetricEffectDuration: want}, got)
	require.Len(t, tel.sets, 3)

	for i := range maxCachedSets + 10 {
		end(fmt.Sprint("T", i), OutcomeClaimed, nil)
	}
	require.Len(t, tel.sets, maxCachedSets)
}

// TestTelemetryAllocations bounds what the telemetry of one attempt allocates
// when its span is not recorded (no TracerProvider, or not sampled) and its
// metric attributes are cached: the span's start options and name, the
// hash's hex, the record, and the context the noop tracer returns. Attributes for the end of
// a span that is not recorded, and the instruments' variadic options, are not
// built.
func TestTelemetryAllocations(t *testing.T) {
	tel, err := newTelemetry(tracenoop.NewTracerProvider(), metricnoop.NewMeterProvider(), false, "t", MismatchReject)
	require.NoError(t, err)
	ctx := context.Background()
	info := activity.Info{ActivityType: activity.Type{Name: "A"}, Namespace: "ns", TaskQueue: "q", Attempt: 1}
	id := Identity{Kind: KindActivity, Namespace: "ns", RunID: "r", ActivityID: "1"}
	var hash [32]byte
	attempt := func() {
		_, r := tel.start(ctx, info, id, hash)
		r.outcome, r.ranEffect = OutcomeClaimed, true
		tel.end(ctx, r, nil)
	}
	attempt() // caches the attribute set
	// 7 with go1.26.8 and go1.27.3, OpenTelemetry v1.47.0 (13 before the end's attributes
	// and the instruments' option slices were skipped): the record, the
	// span's name, the hash's hex, the start attributes, their option and
	// the options' slice, and the context holding the span.
	require.LessOrEqual(t, testing.AllocsPerRun(100, attempt), 7.0,
		"more allocations per attempt: if an upgrade of Go or OpenTelemetry added them, measure again and update the bound and the comment above")
}

// collectSums returns the int64 sums of reader by metric name, each point
// keyed by its attributes as "k=v,k=v" (sorted by key).
func collectSums(t *testing.T, reader *sdkmetric.ManualReader) map[string]map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	out := map[string]map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			sum, ok := m.Data.(metricdata.Sum[int64])
			if !ok {
				continue
			}
			for _, dp := range sum.DataPoints {
				var kv []string
				for _, a := range dp.Attributes.ToSlice() {
					kv = append(kv, string(a.Key)+"="+a.Value.String())
				}
				if out[m.Name] == nil {
					out[m.Name] = map[string]int64{}
				}
				out[m.Name][strings.Join(kv, ",")] += dp.Value
			}
		}
	}
	return out
}

// TestSeriesStartAtZero: the pruned counter's series of the table exists
// at zero once the telemetry is made, and the first attempt of an activity
// type, namespace and task queue makes the attempt counter's series of the
// outcomes and error types known up front at zero, through the
// MeterProvider and the SDK's handler (whose series carry the workflow
// type): PromQL's increase() and rate() see no increase in a series that
// first appears at 1, so the first payload mismatch, claim timeout or prune
// would never show. The set of combinations is bounded.
func TestSeriesStartAtZero(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	tel, err := newTelemetry(tracenoop.NewTracerProvider(), sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)), true, "s.t", MismatchReject)
	require.NoError(t, err)
	require.Equal(t, map[string]map[string]int64{MetricMarkersPruned: {"dedup.table=s.t": 0}}, collectSums(t, reader))

	sdkReader := sdkmetric.NewManualReader()
	sdk := temporalotel.NewMetricsHandler(temporalotel.MetricsHandlerOptions{
		Meter: sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkReader)).Meter("temporal-sdk-go"), UseMonotonicCounters: true,
	}).WithTags(map[string]string{"workflow_type": "W"}) // as the SDK tags an activity's handler
	ctx := context.Background()
	end := func(activityType string, outcome Outcome, err error) {
		_, span := tel.tracer.Start(ctx, "x")
		tel.end(ctx, &record{span: span, activityType: activityType, namespace: "ns", taskQueue: "q", outcome: outcome,
			sdk: sdk, workflowType: "W"}, err)
	}
	end("A", OutcomeClaimed, nil)
	end("A", OutcomeClaimed, nil)

	zero := []string{"claimed/", "duplicate/", "payload_mismatch/DedupPayloadMismatch", "claim_timeout/DedupClaimTimeout"}
	want := map[string]int64{}
	sdkWant := map[string]int64{}
	for _, z := range zero {
		o, et, _ := strings.Cut(z, "/")
		k := "activity_type=A,dedup.outcome=" + o
		if et != "" {
			k += ",error.type=" + et
		}
		want[k+",namespace=ns,task_queue=q"] = 0
		sdkWant["activity_type=A,dedup_outcome="+o+",error_type="+et+",namespace=ns,task_queue=q,workflow_type=W"] = 0
	}
	want["activity_type=A,dedup.outcome=claimed,namespace=ns,task_queue=q"] = 2
	sdkWant["activity_type=A,dedup_outcome=claimed,error_type=,namespace=ns,task_queue=q,workflow_type=W"] = 2
	require.Equal(t, want, collectSums(t, reader)[MetricAttempts])
	require.Equal(t, sdkWant, collectSums(t, sdkReader)["dedup_attempts"])

	// Under MismatchReturnStored a payload mismatch without an error is
	// made too.
	stored, err := newTelemetry(tracenoop.NewTracerProvider(), metricnoop.NewMeterProvider(), false, "t", MismatchReturnStored)
	require.NoError(t, err)
	require.Contains(t, stored.zeroOutcomes, outcomeType{OutcomePayloadMismatch, ""})
	require.Contains(t, stored.zeroOutcomes, outcomeType{OutcomePayloadMismatch, ErrTypePayloadMismatch}, "another activity type's delivery is rejected under every policy")
	require.NotContains(t, tel.zeroOutcomes, outcomeType{OutcomePayloadMismatch, ""})

	for i := range maxSeeded + 10 {
		end(fmt.Sprint("T", i), OutcomeClaimed, nil)
	}
	require.Len(t, tel.seeded, maxSeeded)
}

// TestSeedingLeavesRoomForRealSeries: the zero series of many activity
// types leave real attempts their own series, under the OpenTelemetry
// SDK's default limit of series per instrument; past it real counts go to
// the overflow series, without their labels.
func TestSeedingLeavesRoomForRealSeries(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	tel, err := newTelemetry(tracenoop.NewTracerProvider(), sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)), false, "t", MismatchReject)
	require.NoError(t, err)
	ctx := context.Background()
	const n = 1000 // activity types, each with one claimed attempt
	for i := range n {
		_, span := tel.tracer.Start(ctx, "x")
		tel.end(ctx, &record{span: span, activityType: fmt.Sprint("A", i), namespace: "ns", taskQueue: "q", outcome: OutcomeClaimed}, nil)
	}
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	var overflow int64
	own := map[string]bool{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != MetricAttempts {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				if v, ok := dp.Attributes.Value(attribute.Key("otel.metric.overflow")); ok && v.AsBool() {
					overflow += dp.Value
				}
				if at, ok := dp.Attributes.Value(activityTypeKey); ok && dp.Value == 1 {
					own[at.AsString()] = true
				}
			}
		}
	}
	require.Zero(t, overflow, "attempts counted in the overflow series")
	require.Len(t, own, n, "every activity type's attempt in its own series")
}
