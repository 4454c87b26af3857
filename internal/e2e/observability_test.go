package e2e

import (
	"context"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
	"github.com/dedupactivity/dedupactivity/internal/obstest"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/receipts"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
	"github.com/dedupactivity/dedupactivity/workflows"
)

// TestObservabilityBackends runs the ledger worker on a dev server with its
// spans exported over OTLP to a real Jaeger v2 and its metrics scraped by a
// real Prometheus, runs transfers whose debit loses its first completion (so
// the retry is a duplicate), and asks both backends what they hold: one
// trace with a RunActivity:Debit span whose Dedup child claimed and another
// whose Dedup child was a duplicate; attempts by outcome, the claim wait
// histogram and a join with the SDK's own metrics on activity_type,
// namespace and task_queue, with the PromQL of docs/observability.md.
func TestObservabilityBackends(t *testing.T) {
	t.Parallel()
	srv := temporaltest.Require(t)
	jaegerBin, promBin := obstest.Require(t, "jaeger"), obstest.Require(t, "prometheus")
	ctx := context.Background()

	j, err := obstest.StartJaeger(jaegerBin)
	require.NoError(t, err)
	t.Cleanup(func() { _ = j.Stop() })
	service := "ledger-e2e-" + randomHex()
	tel, err := ledgerworker.NewTelemetry(ctx, ledgerworker.TelemetryConfig{ServiceName: service, TracesEndpoint: j.OTLPEndpoint, MetricsAddr: "127.0.0.1:0"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tel.Shutdown(context.Background()) })
	p, err := obstest.StartPrometheus(promBin, tel.MetricsAddr, alertRules)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Stop() })

	// The receipts service (its own schema), so Credit's receipts go
	// through the outbox and the relay's metrics have values.
	dest := pgtest.NewSchema(t)
	svc, err := receipts.New(dest.Pool)
	require.NoError(t, err)
	require.NoError(t, svc.Migrate(ctx))
	rs := httptest.NewServer(svc.Handler())
	t.Cleanup(rs.Close)

	s := pgtest.NewSchema(t)
	taskQueue := "tq-" + randomHex()
	w, err := ledgerworker.Start(ctx, ledgerworker.Config{
		TemporalAddress: srv.Address, Namespace: temporaltest.Namespace, TaskQueue: taskQueue, DatabaseURL: s.URL, ReceiptsURL: rs.URL,
	}, tel)
	require.NoError(t, err)
	t.Cleanup(w.Stop)
	require.NoError(t, activities.OpenAccounts(ctx, s.Pool, 1000, "alice", "bob"))
	b := &bundle{server: srv, schema: s, pool: s.Pool, client: w.Client, taskQueue: taskQueue, worker: w}

	transfer := func(i int) {
		_, err := b.transfer(t, workflows.TransferRequest{
			TransferID: fmt.Sprintf("obs-%s-%d", taskQueue, i), From: "alice", To: "bob", Amount: 1,
			StartToClose: 5 * time.Second, Faults: activities.Faults{LoseCompletion: true},
		})
		require.NoError(t, err)
	}
	// One transfer, then wait until Prometheus has scraped its series, then
	// two more: rate() over the scrapes then sees an increase.
	transfer(0)
	sel := fmt.Sprintf(`{task_queue=%q}`, taskQueue)
	query := func(q string) []obstest.Sample {
		t.Helper()
		samples, err := p.Query(ctx, q)
		require.NoError(t, err, q)
		return samples
	}
	require.Eventually(t, func() bool { return len(query(`dedup_attempts_total`+sel)) > 0 }, 30*time.Second, 250*time.Millisecond)
	transfer(1)
	transfer(2)

	// Prometheus: attempts by outcome (3 debits claimed then duplicated, 3
	// credits claimed).
	byOutcome := func() map[string]float64 {
		out := map[string]float64{}
		for _, s := range query(`sum by (dedup_outcome) (dedup_attempts_total` + sel + `)`) {
			out[s.Metric["dedup_outcome"]] = s.Value
		}
		return out
	}
	require.Eventually(t, func() bool { o := byOutcome(); return o["claimed"] == 6 && o["duplicate"] == 3 }, 30*time.Second, 250*time.Millisecond, "%v", byOutcome())
	// One path exports them: the worker's SDK handler is OpenTelemetry's on
	// the same MeterProvider, and Dedup.TemporalMetrics is not set, so no
	// second dedup_attempts_total comes under the SDK's scope.
	scopes := query(`count by (otel_scope_name) (dedup_attempts_total)`)
	require.Len(t, scopes, 1, "%v", scopes)
	require.Equal(t, dedupactivity.ScopeName, scopes[0].Metric["otel_scope_name"])
	perType := query(`sum by (activity_type, namespace, task_queue) (rate(dedup_attempts_total` + sel + `[1m]))`)
	require.Len(t, perType, 2, "Debit and Credit")
	for _, s := range perType {
		require.Equal(t, temporaltest.Namespace, s.Metric["namespace"])
		require.Positive(t, s.Value, "rate over the scrapes of %v", s.Metric)
	}
	p99 := query(`histogram_quantile(0.99, sum by (le) (rate(dedup_claim_duration_seconds_bucket` + sel + `[1m])))`)
	require.Len(t, p99, 1)
	require.Positive(t, p99[0].Value, "the claim wait p99")
	require.Less(t, p99[0].Value, 30.0)
	require.Equal(t, 9.0, query(`sum(dedup_claim_duration_seconds_count` + sel + `)`)[0].Value)
	// The join with the SDK's own metrics, on the labels both carry.
	// Debit alone failed (each transfer's lost completion): its outcomes,
	// at the dedup counter's own values, not multiplied by the failures.
	joined := map[string]float64{}
	for _, s := range query(`sum by (activity_type, namespace, task_queue, dedup_outcome) (dedup_attempts_total` + sel + `)
  and on (activity_type, namespace, task_queue)
  sum by (activity_type, namespace, task_queue) (temporal_activity_execution_failed_total) > 0`) {
		require.Equal(t, activities.DebitName, s.Metric["activity_type"], "%v", s.Metric)
		joined[s.Metric["dedup_outcome"]] = s.Value
	}
	require.Equal(t, 3.0, joined["claimed"], "%v", joined)
	require.Equal(t, 3.0, joined["duplicate"], "%v", joined)

	// Prune one expired marker, so the pruned counter has a value; then run
	// the dashboard's queries. The counter's series was there at zero since
	// the worker started, so increase() sees the first prune: a series that
	// first appears at 1 shows no increase, however many samples follow.
	_, err = s.Pool.Exec(ctx, `UPDATE dedup_marker SET expires_at = now() - interval '1 second' WHERE id_hash = (SELECT id_hash FROM dedup_marker LIMIT 1)`)
	require.NoError(t, err)
	n, err := w.Deduper.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Eventually(t, func() bool { return len(query(`increase(dedup_marker_pruned_total[1m]) > 0`)) > 0 }, 30*time.Second, 250*time.Millisecond,
		"the first prune shows in increase()")

	// The outbox: the relay delivered the three receipts; one, made a dead
	// letter by hand, the reconciler finds applied at the destination.
	countSQL := func(q string) int {
		var n int
		require.NoError(t, s.Pool.QueryRow(ctx, q).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return countSQL(`SELECT count(*) FROM dedup_outbox WHERE state = 'sent'`) == 3 }, 30*time.Second, 100*time.Millisecond)
	_, err = s.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'dead', last_error = 'by hand' WHERE id = (SELECT min(id) FROM dedup_outbox)`)
	require.NoError(t, err)
	// (The worker's reconcile Schedule may settle it first: either way the
	// message is applied and counted once.)
	_, err = w.Reconciler.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, countSQL(`SELECT count(*) FROM dedup_outbox WHERE state = 'applied'`))
	require.Eventually(t, func() bool {
		return len(query(`dedup_outbox_reconciled_total{dedup_outbox_reconcile_action="applied"} == 1`)) > 0 &&
			len(query(`dedup_outbox_deliveries_total{dedup_outbox_result="delivered"} == 3`)) > 0
	}, 30*time.Second, 250*time.Millisecond)
	// The reconciler's series were there at zero since it was made
	// (ReconcilerConfig.Destinations), so its first action shows in
	// increase().
	require.Eventually(t, func() bool {
		return len(query(`increase(dedup_outbox_reconciled_total{dedup_outbox_reconcile_action="applied"}[1m]) > 0`)) > 0
	}, 30*time.Second, 250*time.Millisecond, "the first reconcile shows in increase()")
	checkDashboard(t, p)
	checkAlerts(t, p)

	// Jaeger: flush the spans, then find one trace holding both children.
	require.NoError(t, tel.TracerProvider.(*sdktrace.TracerProvider).ForceFlush(ctx))
	var found bool
	require.Eventually(t, func() bool {
		traces, err := j.Traces(ctx, service, map[string]string{"dedup.outcome": "duplicate"}, 20)
		require.NoError(t, err)
		for _, tr := range traces {
			runActivity := map[string]obstest.Span{}
			for _, s := range tr.Spans {
				if s.OperationName == "RunActivity:"+activities.DebitName {
					runActivity[s.SpanID] = s
				}
			}
			outcomes := map[string]bool{}
			for _, s := range tr.Spans {
				parent, ok := runActivity[s.Parent()]
				if !ok || s.OperationName != "Dedup:"+activities.DebitName {
					continue
				}
				require.Equal(t, parent.Tag("temporalWorkflowID"), s.Tag("temporalWorkflowID"), "one tag search finds both")
				require.Equal(t, parent.Tag("temporalActivityID"), s.Tag("temporalActivityID"))
				outcomes[s.Tag("dedup.outcome")] = true
			}
			if outcomes["claimed"] && outcomes["duplicate"] {
				found = true
				return true
			}
		}
		return false
	}, 30*time.Second, 500*time.Millisecond)
	require.True(t, found)
	services, err := j.Services(ctx)
	require.NoError(t, err)
	require.Contains(t, services, service)
}
