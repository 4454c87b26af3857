package dedupactivity_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	temporalotel "go.temporal.io/sdk/contrib/opentelemetry"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

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

// attempts returns the dedup.attempts counter by outcome, leaving out the
// series made at zero (TestSeriesStartAtZero).
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
					ty, _ := dp.Attributes.Value(attribute.Key("activity_type"))
					require.Equal(t, "Post", ty.AsString())
					ns, _ := dp.Attributes.Value(attribute.Key("namespace"))
					require.Equal(t, testNamespace, ns.AsString())
					tq, _ := dp.Attributes.Value(attribute.Key("task_queue"))
					require.Equal(t, testTaskQueue, tq.AsString())
					if dp.Value == 0 {
						continue
					}
					et, hasErr := dp.Attributes.Value(attribute.Key("error.type"))
					key := o.AsString()
					if hasErr {
						key += "/" + et.AsString()
					}
					out[key] += dp.Value
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
		outcome   dedupactivity.Outcome
		status    codes.Code
		errorType string
		key       string // the business key
	}{
		{dedupactivity.OutcomeEffectError, codes.Error, "_OTHER", "k"},
		{dedupactivity.OutcomeClaimed, codes.Unset, "", "k"},
		{dedupactivity.OutcomeDuplicate, codes.Unset, "", "k"},
		{dedupactivity.OutcomePayloadMismatch, codes.Error, dedupactivity.ErrTypePayloadMismatch, "k"},
		{dedupactivity.OutcomeClaimTimeout, codes.Error, dedupactivity.ErrTypeClaimTimeout, "a"}, // ends before the holder
		{dedupactivity.OutcomeClaimed, codes.Unset, "", "a"},                                     // the holder
		{dedupactivity.OutcomeError, codes.Error, "DedupNotMigrated", "k"},
	}
	ended := b.spans.Ended()
	require.Len(t, ended, len(want))
	for i, w := range want {
		s := ended[i]
		require.Equal(t, "Dedup:Post", s.Name(), i)
		require.Equal(t, trace.SpanKindInternal, s.SpanKind(), i)
		require.Equal(t, string(w.outcome), attr(s, dedupactivity.OutcomeKey).AsString(), i)
		require.Equal(t, w.status, s.Status().Code, "span %d (%s)", i, w.outcome)
		require.Equal(t, w.errorType, attr(s, attribute.Key("error.type")).AsString(), "span %d (%s)", i, w.outcome)
		require.Equal(t, dedupactivity.ScopeName, s.InstrumentationScope().Name)
		require.Equal(t, "postgresql", attr(s, attribute.Key("db.system.name")).AsString())
		require.Equal(t, "Post", attr(s, attribute.Key("activity_type")).AsString())
		require.NotEmpty(t, attr(s, attribute.Key("temporalActivityID")).AsString())
		require.Equal(t, int64(1), attr(s, attribute.Key("temporal.activity.attempt")).AsInt64())
		require.Equal(t, "default-test-workflow-id", attr(s, attribute.Key("temporalWorkflowID")).AsString())
		require.Equal(t, "default-test-run-id", attr(s, attribute.Key("temporalRunID")).AsString())
		// The keys the SDK's tracing interceptor and metrics use, spelled out
		// so a change of the constants cannot pass unnoticed.
		require.Equal(t, "default-test-workflow-id", attr(s, "temporalWorkflowID").AsString())
		require.Equal(t, "default-test-run-id", attr(s, "temporalRunID").AsString())
		require.Equal(t, attr(s, attribute.Key("temporalActivityID")).AsString(), attr(s, "temporalActivityID").AsString())
		require.Equal(t, "Post", attr(s, "activity_type").AsString())
		require.Equal(t, testNamespace, attr(s, "namespace").AsString())
		require.Equal(t, testTaskQueue, attr(s, "task_queue").AsString())
		id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: testNamespace, ActivityType: "Post", Key: w.key}
		require.Equal(t, hex.EncodeToString(hashOf(id)), attr(s, dedupactivity.IdentityHashKey).AsString(), i)
		require.Equal(t, attribute.FLOAT64, attr(s, dedupactivity.ClaimWaitKey).Type())
	}
	require.Equal(t, int64(1), attr(ended[2], dedupactivity.StoredAttemptKey).AsInt64(), "a duplicate names the attempt that applied the effect")
	require.GreaterOrEqual(t, attr(ended[4], dedupactivity.ClaimWaitKey).AsFloat64(), 0.15, "the claim wait is visible")
	require.Equal(t, "business_key", attr(ended[4], dedupactivity.IdentityKindKey).AsString())

	require.Equal(t, map[string]int64{
		"effect_error/_OTHER": 1, "claimed": 2, "duplicate": 1, "payload_mismatch/DedupPayloadMismatch": 1,
		"claim_timeout/DedupClaimTimeout": 1, "error/DedupNotMigrated": 1,
	}, b.attempts(t))
}

// The test activity environment's namespace and task queue.
const (
	testNamespace = "default-test-namespace"
	testTaskQueue = "default-test-taskqueue"
)

// deliverWithHandler is deliver with h as the SDK's metrics handler (what
// client.Options.MetricsHandler is on a worker).
func deliverWithHandler[In, Out any](t *testing.T, h client.MetricsHandler, name string, fn func(context.Context, In) (Out, error), in In) error {
	t.Helper()
	var s testsuite.WorkflowTestSuite
	s.SetMetricsHandler(h)
	env := s.NewTestActivityEnvironment()
	env.RegisterActivityWithOptions(fn, activity.RegisterOptions{Name: name})
	_, err := env.ExecuteActivity(name, in)
	return err
}

// sdkMetrics collects what went through an SDK metrics handler backed by
// reader: dedup_attempts by "outcome[/error_type]" (not the series made at
// zero), and the number of observations of each timer.
func sdkMetrics(t *testing.T, reader *sdkmetric.ManualReader) (attempts map[string]int64, timers map[string]uint64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	attempts, timers = map[string]int64{}, map[string]uint64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				if m.Name != "dedup_attempts" {
					continue
				}
				for _, dp := range data.DataPoints {
					get := func(k string) string { v, _ := dp.Attributes.Value(attribute.Key(k)); return v.AsString() }
					require.Equal(t, "Post", get("activity_type"))
					require.Equal(t, testNamespace, get("namespace"))
					require.Equal(t, testTaskQueue, get("task_queue"))
					if dp.Value == 0 {
						continue
					}
					key := get("dedup_outcome")
					if et := get("error_type"); et != "" {
						key += "/" + et
					}
					attempts[key] += dp.Value
				}
			case metricdata.Histogram[float64]:
				require.Equal(t, "s", m.Unit, m.Name)
				for _, dp := range data.DataPoints {
					timers[m.Name] += dp.Count
				}
			}
		}
	}
	return attempts, timers
}

// TestTelemetryTemporalMetrics records through the SDK's metrics handler
// (here the SDK's OpenTelemetry handler over a manual reader, as a worker
// would with client.Options.MetricsHandler) when Options.TemporalMetrics is
// set, and through it not at all when it is not; the OpenTelemetry path
// counts the same attempts either way.
func TestTelemetryTemporalMetrics(t *testing.T) {
	t.Parallel()
	for _, on := range []bool{true, false} {
		t.Run(fmt.Sprintf("TemporalMetrics=%v", on), func(t *testing.T) {
			t.Parallel()
			b := setupTelemetry(t, dedupactivity.Options{TemporalMetrics: on})
			reader := sdkmetric.NewManualReader()
			h := temporalotel.NewMetricsHandler(temporalotel.MetricsHandlerOptions{
				Meter:                sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("temporal-sdk-go"),
				UseMonotonicCounters: true,
			})
			fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(Transfer) (string, error) { return "k", nil }))
			in := Transfer{Account: "a", Amount: 1}
			require.NoError(t, deliverWithHandler(t, h, "Post", fn, in))                              // claimed
			require.NoError(t, deliverWithHandler(t, h, "Post", fn, in))                              // duplicate
			require.Error(t, deliverWithHandler(t, h, "Post", fn, Transfer{Account: "a", Amount: 2})) // payload_mismatch

			want := map[string]int64{"claimed": 1, "duplicate": 1, "payload_mismatch/DedupPayloadMismatch": 1}
			require.Equal(t, want, b.attempts(t), "the OpenTelemetry path")
			attempts, timers := sdkMetrics(t, reader)
			if !on {
				require.Empty(t, attempts)
				require.Zero(t, timers["dedup_claim_duration"])
				return
			}
			require.Equal(t, want, attempts, "the SDK handler path")
			require.Equal(t, uint64(3), timers["dedup_claim_duration"])
			require.Equal(t, uint64(1), timers["dedup_effect_duration"], "the effect ran once")
		})
	}
}

// TestTableLabelNamesTheSchema: Dedupers on tables of one name in two
// schemas report their markers under two dedup.table values.
func TestTableLabelNamesTheSchema(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	var want []string
	for _, s := range []string{b.schema.Name + "_a", b.schema.Name + "_b"} {
		t.Cleanup(func() { _, _ = b.pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+s+` CASCADE`) })
		d, err := dedupactivity.New(b.pool, dedupactivity.Options{Schema: s, Table: "markers", MeterProvider: mp})
		require.NoError(t, err)
		require.NoError(t, d.Migrate(ctx))
		_, err = deliver(t, "Post", dedupactivity.Wrap(d, b.post), Transfer{Account: "a", Amount: 1})
		require.NoError(t, err)
		want = append(want, s+".markers")
	}
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	var got []string
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == dedupactivity.MetricOldestMarkerAge {
				for _, dp := range m.Data.(metricdata.Gauge[float64]).DataPoints {
					tbl, _ := dp.Attributes.Value(dedupactivity.TableKey)
					got = append(got, tbl.AsString())
				}
			}
		}
	}
	require.ElementsMatch(t, want, got)
}

// TestTelemetryMarkerMetrics checks the pruned-markers counter (both paths)
// and the oldest-marker-age and overdue gauges, read from the table at
// collection.
func TestTelemetryMarkerMetrics(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{TemporalMetrics: true})
	ctx := context.Background()
	collect := func() (pruned int64, age, overdue []float64) {
		var rm metricdata.ResourceMetrics
		require.NoError(t, b.reader.Collect(ctx, &rm))
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				switch m.Name {
				case dedupactivity.MetricMarkersPruned:
					require.Equal(t, "{marker}", m.Unit)
					for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
						tbl, _ := dp.Attributes.Value(dedupactivity.TableKey)
						require.Equal(t, "dedup_marker", tbl.AsString())
						pruned += dp.Value
					}
				case dedupactivity.MetricOldestMarkerAge:
					require.Equal(t, "s", m.Unit)
					for _, dp := range m.Data.(metricdata.Gauge[float64]).DataPoints {
						age = append(age, dp.Value)
					}
				case dedupactivity.MetricOverdueMarkerAge:
					require.Equal(t, "s", m.Unit)
					for _, dp := range m.Data.(metricdata.Gauge[float64]).DataPoints {
						tbl, _ := dp.Attributes.Value(dedupactivity.TableKey)
						require.Equal(t, "dedup_marker", tbl.AsString())
						overdue = append(overdue, dp.Value)
					}
				}
			}
		}
		return pruned, age, overdue
	}
	_, age, overdue := collect()
	require.Empty(t, age, "no markers: no observation")
	require.Equal(t, []float64{0}, overdue, "no markers: none overdue")

	fn := dedupactivity.Wrap(b.d, b.post)
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	_, age, overdue = collect()
	require.Len(t, age, 1)
	require.Equal(t, []float64{0}, overdue, "a marker in its retention")
	_, err = b.pool.Exec(ctx, `UPDATE dedup_marker SET claimed_at = now() - interval '2 hours', expires_at = now() - interval '3 minutes'`)
	require.NoError(t, err)
	_, age, overdue = collect()
	require.Len(t, age, 1)
	require.InDelta(t, 7200, age[0], 60, "the marker's age")
	require.Len(t, overdue, 1)
	require.InDelta(t, 180, overdue[0], 30, "expired 3 minutes ago")

	// Prune through the registered prune activity, so the SDK handler path
	// is exercised too.
	reader := sdkmetric.NewManualReader()
	var s testsuite.WorkflowTestSuite
	s.SetMetricsHandler(temporalotel.NewMetricsHandler(temporalotel.MetricsHandlerOptions{
		Meter: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("temporal-sdk-go"), UseMonotonicCounters: true,
	}))
	env := s.NewTestActivityEnvironment()
	dedupactivity.RegisterPruner(activityRegistry{env: env}, b.d)
	val, err := env.ExecuteActivity(dedupactivity.PruneActivityName(b.d))
	require.NoError(t, err)
	var res dedupactivity.PruneResult
	require.NoError(t, val.Get(&res))
	require.Equal(t, int64(1), res.Deleted)

	pruned, age, overdue := collect()
	require.Equal(t, int64(1), pruned)
	require.Empty(t, age, "the table is empty again")
	require.Equal(t, []float64{0}, overdue, "pruned")

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	var sdkPruned int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == "dedup_marker_pruned" {
				for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
					sdkPruned += dp.Value
				}
			}
		}
	}
	require.Equal(t, int64(1), sdkPruned)
}

// activityRegistry lets RegisterPruner register its activity on a test
// activity environment (the workflow is not needed there).
type activityRegistry struct {
	worker.Registry
	env *testsuite.TestActivityEnvironment
}

func (r activityRegistry) RegisterWorkflowWithOptions(any, workflow.RegisterOptions) {}

func (r activityRegistry) RegisterActivityWithOptions(fn any, o activity.RegisterOptions) {
	r.env.RegisterActivityWithOptions(fn, o)
}

// tagKeys is a client.MetricsHandler that records, for each dedup_* metric
// name, every set of tag keys it was emitted with (the SDK's own tags, from
// WithTags, included): a Prometheus registry, such as Tally's reporter,
// takes one set of label names per metric name and refuses any other.
type tagKeys struct {
	tags map[string]string
	rec  *tagKeysRecord
}

type tagKeysRecord struct {
	mu   sync.Mutex
	sets map[string]map[string]bool // metric name -> sorted tag keys, joined
}

func newTagKeys() tagKeys {
	return tagKeys{tags: map[string]string{}, rec: &tagKeysRecord{sets: map[string]map[string]bool{}}}
}

func (h tagKeys) emit(name string) {
	if !strings.HasPrefix(name, "dedup_") {
		return // the SDK's own metrics
	}
	keys := slices.Sorted(maps.Keys(h.tags))
	h.rec.mu.Lock()
	defer h.rec.mu.Unlock()
	if h.rec.sets[name] == nil {
		h.rec.sets[name] = map[string]bool{}
	}
	h.rec.sets[name][strings.Join(keys, ",")] = true
}

func (h tagKeys) WithTags(tags map[string]string) client.MetricsHandler {
	merged := maps.Clone(h.tags)
	maps.Copy(merged, tags)
	return tagKeys{tags: merged, rec: h.rec}
}

func (h tagKeys) Counter(name string) client.MetricsCounter {
	return metricFunc(func() { h.emit(name) })
}

func (h tagKeys) Gauge(name string) client.MetricsGauge { return metricFunc(func() { h.emit(name) }) }

func (h tagKeys) Timer(name string) client.MetricsTimer { return metricFunc(func() { h.emit(name) }) }

// metricFunc is a counter, gauge and timer that calls itself on each use.
type metricFunc func()

func (f metricFunc) Inc(int64)            { f() }
func (f metricFunc) Update(float64)       { f() }
func (f metricFunc) Record(time.Duration) { f() }

// TestTemporalMetricsTagKeys: through the SDK's handler, every emission of
// one metric name carries the same tag keys, whether the attempt succeeded
// or failed (error_type is "" on success). A Prometheus registry (Tally's
// reporter) refuses a name registered with other label names: the failed
// attempts were dropped, or its default error handler panicked in the
// attempt.
func TestTemporalMetricsTagKeys(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{TemporalMetrics: true})
	h := newTagKeys()
	fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(Transfer) (string, error) { return "k", nil }))
	in := Transfer{Account: "a", Amount: 1}
	require.NoError(t, deliverWithHandler(t, h, "Post", fn, in))                              // claimed
	require.NoError(t, deliverWithHandler(t, h, "Post", fn, in))                              // duplicate
	require.Error(t, deliverWithHandler(t, h, "Post", fn, Transfer{Account: "a", Amount: 2})) // payload_mismatch

	h.rec.mu.Lock()
	defer h.rec.mu.Unlock()
	for _, name := range []string{"dedup_attempts", "dedup_claim_duration"} {
		require.Len(t, h.rec.sets[name], 1, "%s: one set of tag keys, got %v", name, h.rec.sets[name])
		for keys := range h.rec.sets[name] {
			require.Contains(t, strings.Split(keys, ","), "error_type", name)
		}
	}
}

// TestAttemptsThatFailBeforeTheClaim: an attempt that fails before it can
// claim (the business key function's error, an identity the Deduper
// refuses, a delivery the partitioned layout refuses, ClaimTx on a nil tx)
// is traced and counted as OutcomeError with its error.type, like any
// other failed attempt, and records no claim duration. Before, it returned
// ahead of the telemetry: no span, and no dedup.attempts series to alert on.
func TestAttemptsThatFailBeforeTheClaim(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{})
	keyErr := errors.New("no key in the input")
	keys := map[int64]func() (string, error){
		1: func() (string, error) { return "", keyErr },
		2: func() (string, error) { return "", temporal.NewNonRetryableApplicationError("no key", "NoKey", nil) },
		3: func() (string, error) { return "", nil }, // ErrEmptyBusinessKey
	}
	fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return keys[in.Amount]() }))
	for amount := range int64(3) {
		_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: amount + 1})
		require.Error(t, err)
	}
	require.Equal(t, map[string]int64{"error/_OTHER": 1, "error/NoKey": 1, "error/" + dedupactivity.ErrTypeInvalidUsage: 1}, b.attempts(t))
	ended := b.spans.Ended()
	require.Len(t, ended, 3)
	for i, wantType := range []string{"_OTHER", "NoKey", dedupactivity.ErrTypeInvalidUsage} {
		s := ended[i]
		require.Equal(t, "Dedup:Post", s.Name())
		require.Equal(t, codes.Error, s.Status().Code, i)
		require.Equal(t, string(dedupactivity.OutcomeError), attr(s, dedupactivity.OutcomeKey).AsString(), i)
		require.Equal(t, wantType, attr(s, attribute.Key("error.type")).AsString(), i)
		require.Equal(t, "business_key", attr(s, dedupactivity.IdentityKindKey).AsString(), i)
		require.Equal(t, attribute.EMPTY, attr(s, dedupactivity.IdentityHashKey).Type(), "no identity, no hash")
		require.Equal(t, testTaskQueue, attr(s, "task_queue").AsString())
	}
	// ClaimTx on a nil tx, and an identity of no known kind.
	_, err := dedupactivity.ClaimTx[Posting](context.Background(), b.d, nil, dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "ns", ActivityType: "Post", Key: "k"}, nil)
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	_, _, err = dedupactivity.Do(context.Background(), b.d, dedupactivity.Identity{Namespace: "ns"}, Transfer{}, b.post)
	require.ErrorIs(t, err, dedupactivity.ErrInvalidIdentity)
	require.Len(t, b.spans.Ended(), 5)
	for _, s := range b.spans.Ended()[3:] {
		require.Equal(t, codes.Error, s.Status().Code)
		require.Equal(t, dedupactivity.ErrTypeInvalidUsage, attr(s, attribute.Key("error.type")).AsString())
	}
	require.Equal(t, int64(3), outsideAttempts(t, b.reader)["error/"+dedupactivity.ErrTypeInvalidUsage], "the empty key and these two")
	var rm metricdata.ResourceMetrics
	require.NoError(t, b.reader.Collect(context.Background(), &rm))
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			require.NotEqual(t, dedupactivity.MetricClaimDuration, m.Name, "nothing was claimed")
		}
	}

	// The partitioned layout refuses Do outside an activity: traced with
	// the identity's hash, and counted.
	p := setupTelemetry(t, dedupactivity.Options{PartitionInterval: time.Hour})
	id := dedupactivity.Identity{Kind: dedupactivity.KindActivity, Namespace: "ns", WorkflowID: "w", RunID: "r", ActivityID: "1"}
	_, _, err = dedupactivity.Do(context.Background(), p.d, id, Transfer{}, p.post)
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	require.Len(t, p.spans.Ended(), 1)
	s := p.spans.Ended()[0]
	require.Equal(t, codes.Error, s.Status().Code)
	require.Equal(t, hex.EncodeToString(hashOf(id)), attr(s, dedupactivity.IdentityHashKey).AsString())
	require.Equal(t, int64(1), outsideAttempts(t, p.reader)["error/"+dedupactivity.ErrTypeInvalidUsage])

	// An identity refused for its size names an activity type of any
	// length and bytes: its span and labels carry at most 128 bytes of it,
	// as valid UTF-8.
	l := setupTelemetry(t, dedupactivity.Options{})
	huge := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "ns", ActivityType: "\xff" + strings.Repeat("é", dedupactivity.MaxIdentityBytes), Key: "k",
		WorkflowID: "\xff" + strings.Repeat("w", dedupactivity.MaxIdentityBytes)}
	_, _, err = dedupactivity.Do(context.Background(), l.d, huge, Transfer{}, l.post)
	require.ErrorIs(t, err, dedupactivity.ErrIdentityTooLarge)
	require.Len(t, l.spans.Ended(), 1)
	got := attr(l.spans.Ended()[0], "activity_type").AsString()
	require.True(t, utf8.ValidString(got), "%q", got)
	require.LessOrEqual(t, len(got), 128)
	require.True(t, strings.HasPrefix(got, "\uFFFDé"), "%q", got)
	for _, kv := range l.spans.Ended()[0].Attributes() {
		if kv.Value.Type() == attribute.STRING {
			require.True(t, utf8.ValidString(kv.Value.AsString()), "%s", kv.Key)
			require.LessOrEqual(t, len(kv.Value.AsString()), 128, "%s", kv.Key)
		}
	}
	var labels []string
	var rm2 metricdata.ResourceMetrics
	require.NoError(t, l.reader.Collect(context.Background(), &rm2))
	for _, sm := range rm2.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == dedupactivity.MetricAttempts {
				for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
					v, _ := dp.Attributes.Value("activity_type")
					labels = append(labels, v.AsString())
				}
			}
		}
	}
	require.NotEmpty(t, labels)
	for _, v := range labels {
		require.Equal(t, got, v)
	}
}

// outsideAttempts returns the non-zero dedup.attempts series of reader by
// "outcome/error.type", whatever their other attributes.
func outsideAttempts(t *testing.T, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for series, v := range allAttemptSeries(t, reader) {
		if v != 0 {
			_, outcomeType, _ := strings.Cut(series, "/") // drops the activity type
			out[outcomeType] += v
		}
	}
	return out
}

// allAttemptSeries returns every dedup.attempts series of reader, those at
// zero included, by "activity_type/outcome/error.type".
func allAttemptSeries(t *testing.T, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != dedupactivity.MetricAttempts {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				ty, _ := dp.Attributes.Value("activity_type")
				o, _ := dp.Attributes.Value(dedupactivity.OutcomeKey)
				et, _ := dp.Attributes.Value(attribute.Key("error.type"))
				out[ty.AsString()+"/"+o.AsString()+"/"+et.AsString()] += dp.Value
			}
		}
	}
	return out
}

// histograms returns, per duration histogram, the count and the sum of its
// observations by outcome.
func histograms(t *testing.T, b *telemetryBundle) (counts map[string]map[string]uint64, sums map[string]map[string]float64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, b.reader.Collect(context.Background(), &rm))
	counts, sums = map[string]map[string]uint64{}, map[string]map[string]float64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != dedupactivity.MetricClaimDuration && m.Name != dedupactivity.MetricEffectDuration {
				continue
			}
			counts[m.Name], sums[m.Name] = map[string]uint64{}, map[string]float64{}
			for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
				o, _ := dp.Attributes.Value(dedupactivity.OutcomeKey)
				counts[m.Name][o.AsString()] += dp.Count
				sums[m.Name][o.AsString()] += dp.Sum
			}
		}
	}
	return counts, sums
}

// TestDuplicateNamesTheAttemptThatApplied: a duplicate's span names the
// attempt that applied the effect (dedup.stored.attempt, read from the
// marker), not its own. In the workflow test environment the retry after a
// lost completion is attempt 2, so the two differ; in the activity test
// environment every delivery is attempt 1 and a test there cannot tell them
// apart.
func TestDuplicateNamesTheAttemptThatApplied(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{})
	wrapped := dedupactivity.Wrap(b.d, b.post)
	driver := func(ctx context.Context, in Transfer) (Posting, error) {
		p, err := wrapped(ctx, in)
		if activity.GetInfo(ctx).Attempt == 1 {
			return Posting{}, errors.New("worker lost before completion") // the effect committed
		}
		return p, err
	}
	_, err := runPost(t, driver, "", Transfer{Account: "a", Amount: 5})
	require.NoError(t, err)
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(1), b.count(t, `SELECT attempt FROM dedup_marker`), "attempt 1 applied the effect")

	ended := b.spans.Ended()
	require.Len(t, ended, 2)
	require.Equal(t, string(dedupactivity.OutcomeClaimed), attr(ended[0], dedupactivity.OutcomeKey).AsString())
	require.Equal(t, string(dedupactivity.OutcomeDuplicate), attr(ended[1], dedupactivity.OutcomeKey).AsString())
	require.Equal(t, int64(2), attr(ended[1], attribute.Key("temporal.activity.attempt")).AsInt64(), "the duplicate is attempt 2")
	require.Equal(t, int64(1), attr(ended[1], dedupactivity.StoredAttemptKey).AsInt64(), "it names attempt 1, which applied the effect")
}

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

	counts, _ := histograms(t, b)
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

// TestInputThatCannotBeFingerprintedRecordsNoClaimDuration: a business-keyed
// input the default converter cannot encode fails before its claim, so, as
// every attempt that fails before it, it counts as error and records no
// claim duration (a 0s observation would pull the claim wait's quantiles
// down for a claim that never ran).
func TestInputThatCannotBeFingerprintedRecordsNoClaimDuration(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{})
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "ns", ActivityType: "Post", Key: "k"}
	_, _, err := dedupactivity.Do(context.Background(), b.d, id, make(chan int), func(context.Context, pgx.Tx, chan int) (Posting, error) {
		return Posting{}, nil
	})
	require.ErrorIs(t, err, dedupactivity.ErrEncoding)
	require.Equal(t, int64(1), outsideAttempts(t, b.reader)["error/"+dedupactivity.ErrTypeEncoding])
	var rm metricdata.ResourceMetrics
	require.NoError(t, b.reader.Collect(context.Background(), &rm))
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			require.NotEqual(t, dedupactivity.MetricClaimDuration, m.Name, "nothing was claimed")
		}
	}
}
