package dedupactivity

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// TestMetricAttrsCache counts attempts of two activity types, each twice
// (the second from the cache of attribute sets), and a failed one, whose
// error.type is never cached; the cache stops growing at maxCachedSets.
func TestMetricAttrsCache(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	tel, err := newTelemetry(tracenoop.NewTracerProvider(), sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)), false, "t")
	require.NoError(t, err)
	ctx := context.Background()
	end := func(activityType string, outcome Outcome, err error) {
		_, span := tel.tracer.Start(ctx, "x")
		tel.end(ctx, &record{span: span, activityType: activityType, namespace: "ns", taskQueue: "q", outcome: outcome}, err)
	}
	for range 2 {
		end("A", OutcomeClaimed, nil)
		end("B", OutcomeClaimed, nil)
		end("A", OutcomeDuplicate, nil)
	}
	end("A", OutcomeClaimed, errors.New("lost"))

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != MetricAttempts {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				get := func(k attribute.Key) string { v, _ := dp.Attributes.Value(k); return v.AsString() }
				got[get(activityTypeKey)+"/"+get(OutcomeKey)+"/"+get(errorTypeKey)] += dp.Value
			}
		}
	}
	require.Equal(t, map[string]int64{"A/claimed/": 2, "B/claimed/": 2, "A/duplicate/": 2, "A/claimed/_OTHER": 1}, got)
	require.Len(t, tel.sets, 3)

	for i := range maxCachedSets + 10 {
		end(fmt.Sprint("T", i), OutcomeClaimed, nil)
	}
	require.Len(t, tel.sets, maxCachedSets)
}
