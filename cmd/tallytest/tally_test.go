package tallytest_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"github.com/uber-go/tally/v4"
	promreporter "github.com/uber-go/tally/v4/prometheus"
	"go.opentelemetry.io/otel/metric/noop"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// tallyHandler is the SDK's MetricsHandler over a Tally scope, as
// go.temporal.io/sdk/contrib/tally.NewMetricsHandler makes it (that module
// is not served by the module proxy here; its handler is these four
// methods).
type tallyHandler struct{ scope tally.Scope }

func (h tallyHandler) WithTags(tags map[string]string) client.MetricsHandler {
	return tallyHandler{h.scope.Tagged(tags)}
}
func (h tallyHandler) Counter(name string) client.MetricsCounter { return h.scope.Counter(name) }
func (h tallyHandler) Gauge(name string) client.MetricsGauge     { return h.scope.Gauge(name) }
func (h tallyHandler) Timer(name string) client.MetricsTimer     { return h.scope.Timer(name) }

// prometheusSanitize is contrib/tally's PrometheusSanitizeOptions.
var prometheusSanitize = tally.SanitizeOptions{
	NameCharacters:       tally.ValidCharacters{Ranges: tally.AlphanumericRange, Characters: []rune{'_'}},
	KeyCharacters:        tally.ValidCharacters{Ranges: tally.AlphanumericRange, Characters: []rune{'_'}},
	ValueCharacters:      tally.ValidCharacters{Ranges: tally.AlphanumericRange, Characters: []rune{'_'}},
	ReplacementCharacter: tally.DefaultReplacementCharacter,
}

// TestTallyPrometheusReporter runs a wrapped activity with TemporalMetrics on
// the SDK's Tally handler, reporting to a Prometheus pedantic registry as the
// SDK's documentation sets it up (cached reporter, histogram timers,
// Prometheus sanitizing): a claimed, a duplicate and a rejected payload
// mismatch. The reporter registers each name's label names once and
// refuses others (its default error handler panics): every attempt, failed
// or not, must be registered and gathered, the successes with an empty
// error_type; the outcomes known up front are there at zero.
func TestTallyPrometheusReporter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgtest.NewSchema(t)
	d, err := dedupactivity.New(s.Pool, dedupactivity.Options{TemporalMetrics: true, MeterProvider: noop.NewMeterProvider()})
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	_, err = s.Pool.Exec(ctx, `CREATE TABLE entry (id bigserial PRIMARY KEY, amount bigint NOT NULL)`)
	require.NoError(t, err)

	reg := prometheus.NewPedanticRegistry()
	var mu sync.Mutex
	var registerErrs []error
	reporter := promreporter.NewReporter(promreporter.Options{
		Registerer:       reg,
		DefaultTimerType: promreporter.HistogramTimerType,
		OnRegisterError: func(err error) {
			mu.Lock()
			defer mu.Unlock()
			registerErrs = append(registerErrs, err)
		},
	})
	scope, closer := tally.NewRootScope(tally.ScopeOptions{
		CachedReporter:  reporter,
		Separator:       promreporter.DefaultSeparator,
		SanitizeOptions: &prometheusSanitize,
	}, time.Second)

	type input struct{ Amount int64 }
	post := dedupactivity.Wrap(d, func(ctx context.Context, tx pgx.Tx, in input) (int64, error) {
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO entry (amount) VALUES ($1) RETURNING id`, in.Amount).Scan(&id)
		return id, err
	}, dedupactivity.WithBusinessKey(func(input) (string, error) { return "k", nil }))
	deliver := func(in input) error {
		var suite testsuite.WorkflowTestSuite
		suite.SetMetricsHandler(tallyHandler{scope})
		env := suite.NewTestActivityEnvironment()
		env.RegisterActivityWithOptions(post, activity.RegisterOptions{Name: "Post"})
		_, err := env.ExecuteActivity("Post", in)
		return err
	}
	require.NoError(t, deliver(input{1})) // claimed
	require.NoError(t, deliver(input{1})) // duplicate
	require.Error(t, deliver(input{2}))   // payload_mismatch
	require.NoError(t, closer.Close())    // reports what is left

	mu.Lock()
	require.Empty(t, registerErrs, "the reporter refused a registration")
	mu.Unlock()
	families, err := reg.Gather()
	require.NoError(t, err)
	attempts := map[string]float64{} // dedup_outcome/error_type
	zeros := map[string]bool{}       // the series made at zero
	timers := map[string]uint64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			switch f.GetName() {
			case "dedup_attempts":
				require.Equal(t, dto.MetricType_COUNTER, f.GetType())
				require.Contains(t, labels, "error_type")
				require.Equal(t, "Post", labels["activity_type"])
				k := labels["dedup_outcome"] + "/" + labels["error_type"]
				if v := m.GetCounter().GetValue(); v != 0 {
					attempts[k] += v
				} else {
					zeros[k] = true
				}
			case "dedup_claim_duration", "dedup_effect_duration":
				timers[f.GetName()] += m.GetHistogram().GetSampleCount()
			}
		}
	}
	require.Equal(t, map[string]float64{"claimed/": 1, "duplicate/": 1, "payload_mismatch/DedupPayloadMismatch": 1}, attempts)
	require.Equal(t, map[string]uint64{"dedup_claim_duration": 3, "dedup_effect_duration": 1}, timers)
	// The outcomes the dashboard and alerts read were made at zero with the
	// first attempt, so the next of each shows in increase() and rate():
	// of those, claim_timeout is the one this test did not count.
	require.Equal(t, map[string]bool{"claim_timeout/DedupClaimTimeout": true}, zeros)
}
