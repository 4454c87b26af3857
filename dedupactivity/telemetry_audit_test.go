package dedupactivity_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	temporalotel "go.temporal.io/sdk/contrib/opentelemetry"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// TestErrorTypeOfEffectErrors: an effect's error is traced and counted
// under the error.type docs/observability.md lists, in its order: the
// effect's ApplicationError type, a PostgreSQL error's SQLSTATE,
// context.Canceled and context.DeadlineExceeded (also wrapped), and
// _OTHER. Each span has status Error and the error recorded as an
// exception event with its message.
func TestErrorTypeOfEffectErrors(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{})
	errs := map[int64]error{
		2: fmt.Errorf("stopped: %w", context.Canceled),
		3: fmt.Errorf("too slow: %w", context.DeadlineExceeded),
		4: temporal.NewNonRetryableApplicationError("bad transfer", "BadTransfer", nil),
		5: errors.New("plain failure"),
	}
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		if in.Amount == 1 {
			_, err := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES (NULL, 1)`) // 23502, not_null_violation
			return Posting{}, err
		}
		return Posting{}, errs[in.Amount]
	}, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return fmt.Sprint(in.Amount), nil }))
	wantType := []string{"23502", "context.Canceled", "context.DeadlineExceeded", "BadTransfer", "_OTHER"}
	var messages []string
	for amount := int64(1); amount <= 5; amount++ {
		_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: amount})
		require.Error(t, err)
		messages = append(messages, err.Error())
	}
	ended := b.spans.Ended()
	require.Len(t, ended, 5)
	want := map[string]int64{}
	for i, s := range ended {
		require.Equal(t, string(dedupactivity.OutcomeEffectError), attr(s, dedupactivity.OutcomeKey).AsString(), i)
		require.Equal(t, wantType[i], attr(s, attribute.Key("error.type")).AsString(), i)
		require.Equal(t, codes.Error, s.Status().Code, i)
		var recorded []string
		for _, ev := range s.Events() {
			if ev.Name != "exception" {
				continue
			}
			for _, kv := range ev.Attributes {
				if kv.Key == "exception.message" {
					recorded = append(recorded, kv.Value.AsString())
				}
			}
		}
		require.Equal(t, []string{messages[i]}, recorded, "span %d records the error as an exception event", i)
		want["effect_error/"+wantType[i]]++
	}
	require.Equal(t, want, b.attempts(t))
	require.Zero(t, b.ledgerRows(t))
}

// TestDurationHistogramsByOutcome: on the OpenTelemetry path the effect
// duration is recorded only by the attempt that ran the effect, and the
// claim duration once by every attempt that claimed (claimed, duplicate,
// payload_mismatch alike), each under its outcome.
// (TestTelemetryTemporalMetrics counts these on the SDK handler's path;
// the OTel path's histograms were only checked to be non-empty.)
func TestDurationHistogramsByOutcome(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{})
	fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(Transfer) (string, error) { return "k", nil }))
	in := Transfer{Account: "a", Amount: 1}
	_, err := deliver(t, "Post", fn, in) // claimed
	require.NoError(t, err)
	_, err = deliver(t, "Post", fn, in) // duplicate
	require.NoError(t, err)
	_, err = deliver(t, "Post", fn, Transfer{Account: "a", Amount: 2}) // payload_mismatch
	require.ErrorIs(t, err, dedupactivity.ErrPayloadMismatch)

	var rm metricdata.ResourceMetrics
	require.NoError(t, b.reader.Collect(context.Background(), &rm))
	counts := map[string]map[string]uint64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != dedupactivity.MetricClaimDuration && m.Name != dedupactivity.MetricEffectDuration {
				continue
			}
			counts[m.Name] = map[string]uint64{}
			for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
				o, _ := dp.Attributes.Value(dedupactivity.OutcomeKey)
				counts[m.Name][o.AsString()] += dp.Count
			}
		}
	}
	require.Equal(t, map[string]uint64{"claimed": 1}, counts[dedupactivity.MetricEffectDuration], "only the claimed attempt ran the effect")
	require.Equal(t, map[string]uint64{"claimed": 1, "duplicate": 1, "payload_mismatch": 1}, counts[dedupactivity.MetricClaimDuration])
}

// TestDoLabelsTheIdentitysNamespace: outside an activity (Do) there is no
// activity info, so the namespace on the span and the metrics is the
// identity's (a consumer's "kafka"), not empty. Two paths give it (the
// info Do makes from the identity, and the telemetry's fallback to the
// identity's namespace): this fails when both are lost, which no other
// test saw.
func TestDoLabelsTheIdentitysNamespace(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{})
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "kafka", ActivityType: "Post", Key: "offset-1"}
	_, outcome, err := dedupactivity.Do(context.Background(), b.d, id, Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)

	ended := b.spans.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, "kafka", attr(ended[0], "namespace").AsString())
	var rm metricdata.ResourceMetrics
	require.NoError(t, b.reader.Collect(context.Background(), &rm))
	var namespaces []string
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != dedupactivity.MetricAttempts {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				ns, _ := dp.Attributes.Value("namespace")
				namespaces = append(namespaces, ns.AsString())
			}
		}
	}
	require.NotEmpty(t, namespaces)
	for _, ns := range namespaces {
		require.Equal(t, "kafka", ns)
	}
}

// TestIdentityKindOnSpans: dedup.identity.kind names the identity's kind
// as documented (activity, local_activity, standalone, business_key), so
// a trace search by kind finds local activities apart from regular ones.
func TestIdentityKindOnSpans(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{})
	fn := dedupactivity.Wrap(b.d, b.post)
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)

	var s testsuite.WorkflowTestSuite
	env := s.NewTestActivityEnvironment()
	_, err = env.ExecuteLocalActivity(fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)

	standalone := dedupactivity.Identity{Kind: dedupactivity.KindStandalone, Namespace: "ns", ActivityID: "1", ActivityRunID: "r"}
	_, _, err = dedupactivity.Do(context.Background(), b.d, standalone, Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)
	keyed := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "ns", ActivityType: "Post", Key: "k"}
	_, _, err = dedupactivity.Do(context.Background(), b.d, keyed, Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)

	var kinds []string
	for _, s := range b.spans.Ended() {
		kinds = append(kinds, attr(s, dedupactivity.IdentityKindKey).AsString())
	}
	require.Equal(t, []string{"activity", "local_activity", "standalone", "business_key"}, kinds)
	require.Equal(t, int64(4), b.ledgerRows(t), "four events")
}

// TestSDKMetricsOfAttemptsThatFailBeforeTheClaim: through the SDK's
// handler too (Options.TemporalMetrics), an attempt that fails before its
// claim (the business key function's error) counts as error with its
// error_type and records neither a claim nor an effect duration.
func TestSDKMetricsOfAttemptsThatFailBeforeTheClaim(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{TemporalMetrics: true})
	reader := sdkmetric.NewManualReader()
	h := temporalotel.NewMetricsHandler(temporalotel.MetricsHandlerOptions{
		Meter:                sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("temporal-sdk-go"),
		UseMonotonicCounters: true,
	})
	fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(Transfer) (string, error) { return "", errors.New("no key") }))
	require.Error(t, deliverWithHandler(t, h, "Post", fn, Transfer{Account: "a", Amount: 1}))
	attempts, timers := sdkMetrics(t, reader)
	require.Equal(t, map[string]int64{"error/_OTHER": 1}, attempts)
	require.Zero(t, timers["dedup_claim_duration"], "nothing was claimed")
	require.Zero(t, timers["dedup_effect_duration"])
}
