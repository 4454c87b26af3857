package dedupactivity_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

type telemetryBundle struct {
	*testBundle
	spans  *tracetest.SpanRecorder
	reader *sdkmetric.ManualReader
}

func setupTelemetry(t *testing.T, opts dedupactivity.Options) *telemetryBundle {
	t.Helper()
	spans := tracetest.NewSpanRecorder()
	reader := sdkmetric.NewManualReader()
	opts.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	opts.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	return &telemetryBundle{testBundle: setup(t, opts), spans: spans, reader: reader}
}

func attr(s sdktrace.ReadOnlySpan, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// attempts returns the dedup.attempts counter by outcome.
func (b *telemetryBundle) attempts(t *testing.T) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, b.reader.Collect(context.Background(), &rm))
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, dedupactivity.ScopeName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			switch m.Name {
			case dedupactivity.MetricAttempts:
				require.Equal(t, "{attempt}", m.Unit)
				for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
					o, _ := dp.Attributes.Value(dedupactivity.OutcomeKey)
					ty, _ := dp.Attributes.Value(dedupactivity.ActivityTypeKey)
					require.Equal(t, "Post", ty.AsString())
					out[o.AsString()] += dp.Value
				}
			case dedupactivity.MetricClaimDuration, dedupactivity.MetricEffectDuration:
				require.Equal(t, "s", m.Unit)
				require.NotEmpty(t, m.Data.(metricdata.Histogram[float64]).DataPoints)
			}
		}
	}
	return out
}

func TestTelemetryOutcomes(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{ClaimWait: 200 * time.Millisecond})
	fail := false
	holding, release := make(chan struct{}), make(chan struct{})
	hold := false
	dedupactivity.SetAfterClaimHook(b.d, func(ctx context.Context, tx pgx.Tx) error {
		if hold {
			hold = false
			close(holding)
			<-release
		}
		return nil
	})
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		if fail {
			return Posting{}, errors.New("effect failed")
		}
		return b.post(ctx, tx, in)
	}, dedupactivity.WithBusinessKey(func(Transfer) (string, error) { return "k", nil })) // one event, compared inputs
	in := Transfer{Account: "a", Amount: 1}

	fail = true
	_, err := deliver(t, "Post", fn, in) // effect_error
	require.Error(t, err)
	fail = false
	_, err = deliver(t, "Post", fn, in) // claimed
	require.NoError(t, err)
	_, err = deliver(t, "Post", fn, in) // duplicate
	require.NoError(t, err)
	_, err = deliver(t, "Post", fn, Transfer{Account: "a", Amount: 2}) // payload_mismatch
	require.Error(t, err)

	// claim_timeout: a holder on another event identity (business key).
	keyed := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return in.Account, nil }))
	hold = true
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _, _ = deliver(t, "Post", keyed, in) }()
	<-holding
	_, err = deliver(t, "Post", keyed, in)
	require.ErrorIs(t, err, dedupactivity.ErrClaimTimeout)
	close(release)
	wg.Wait()

	// error: the marker table is gone.
	_, err = b.pool.Exec(context.Background(), `DROP TABLE dedup_marker`)
	require.NoError(t, err)
	_, err = deliver(t, "Post", fn, Transfer{Account: "b", Amount: 1})
	require.ErrorIs(t, err, dedupactivity.ErrNotMigrated)

	want := []struct {
		outcome dedupactivity.Outcome
		status  codes.Code
	}{
		{dedupactivity.OutcomeEffectError, codes.Error},
		{dedupactivity.OutcomeClaimed, codes.Unset},
		{dedupactivity.OutcomeDuplicate, codes.Unset},
		{dedupactivity.OutcomePayloadMismatch, codes.Error},
		{dedupactivity.OutcomeClaimTimeout, codes.Error}, // ends before the holder
		{dedupactivity.OutcomeClaimed, codes.Unset},      // the holder
		{dedupactivity.OutcomeError, codes.Error},
	}
	ended := b.spans.Ended()
	require.Len(t, ended, len(want))
	for i, w := range want {
		s := ended[i]
		require.Equal(t, "Dedup:Post", s.Name(), i)
		require.Equal(t, string(w.outcome), attr(s, dedupactivity.OutcomeKey).AsString(), i)
		require.Equal(t, w.status, s.Status().Code, "span %d (%s)", i, w.outcome)
		require.Equal(t, dedupactivity.ScopeName, s.InstrumentationScope().Name)
		require.Equal(t, "postgresql", attr(s, dedupactivity.DBSystemKey).AsString())
		require.Equal(t, "Post", attr(s, dedupactivity.ActivityTypeKey).AsString())
		require.NotEmpty(t, attr(s, dedupactivity.ActivityIDKey).AsString())
		require.Equal(t, int64(1), attr(s, dedupactivity.AttemptKey).AsInt64())
		require.Equal(t, "default-test-workflow-id", attr(s, dedupactivity.WorkflowIDKey).AsString())
		require.Equal(t, "default-test-run-id", attr(s, dedupactivity.RunIDKey).AsString())
		require.Len(t, attr(s, dedupactivity.IdentityHashKey).AsString(), 64)
		require.Equal(t, attribute.FLOAT64, attr(s, dedupactivity.ClaimWaitKey).Type())
	}
	require.Equal(t, int64(1), attr(ended[2], dedupactivity.StoredAttemptKey).AsInt64(), "a duplicate names the attempt that applied the effect")
	require.GreaterOrEqual(t, attr(ended[4], dedupactivity.ClaimWaitKey).AsFloat64(), 0.15, "the claim wait is visible")
	require.Equal(t, "business_key", attr(ended[4], dedupactivity.IdentityKindKey).AsString())

	require.Equal(t, map[string]int64{
		"effect_error": 1, "claimed": 2, "duplicate": 1, "payload_mismatch": 1, "claim_timeout": 1, "error": 1,
	}, b.attempts(t))
}
