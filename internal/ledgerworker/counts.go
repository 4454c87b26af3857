package ledgerworker

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// CountsToFile returns a MeterProvider whose dedup.attempts counts are
// written to path as JSON ({"claimed": 3, ...}) every period until ctx is
// done, each write atomic (a rename). The chaos harness reads these files
// from worker processes it kills, so counts are lower bounds by up to one
// period of a killed worker's work.
func CountsToFile(ctx context.Context, path string, period time.Duration) metric.MeterProvider {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	go func() {
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				_ = writeCounts(context.Background(), reader, path)
				return
			case <-t.C:
				_ = writeCounts(ctx, reader, path)
			}
		}
	}()
	return mp
}

// Counts reads dedup.attempts by outcome from reader.
func Counts(ctx context.Context, reader *sdkmetric.ManualReader) (map[string]int64, error) {
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != dedupactivity.MetricAttempts {
				continue
			}
			sum, ok := m.Data.(metricdata.Sum[int64])
			if !ok {
				return nil, fmt.Errorf("%s: unexpected data %T", m.Name, m.Data)
			}
			for _, dp := range sum.DataPoints {
				o, _ := dp.Attributes.Value(dedupactivity.OutcomeKey)
				out[o.AsString()] += dp.Value
			}
		}
	}
	return out, nil
}

func writeCounts(ctx context.Context, reader *sdkmetric.ManualReader, path string) error {
	counts, err := Counts(ctx, reader)
	if err != nil {
		return err
	}
	b, err := json.Marshal(counts)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".counts-*")
	if err != nil {
		return err
	}
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
