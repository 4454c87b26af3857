// Package e2e runs the ledger worker against a real Temporal dev server and a
// real PostgreSQL, with real redeliveries.
package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/worker"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
	"github.com/dedupactivity/dedupactivity/workflows"
)

func TestMain(m *testing.M) {
	code := m.Run()
	temporaltest.StopShared()
	pgtest.StopShared()
	os.Exit(code)
}

type bundle struct {
	server    *temporaltest.Server
	schema    *pgtest.Schema
	pool      *pgxpool.Pool
	client    client.Client
	taskQueue string
	spans     *tracetest.SpanRecorder
	worker    *ledgerworker.Worker
}

// setup starts a ledger worker in this process on its own task queue and
// schema, with spans recorded.
func setup(t *testing.T, register func(worker.Registry, *dedupactivity.Deduper, *pgxpool.Pool)) *bundle {
	t.Helper()
	srv := temporaltest.Require(t)
	s := pgtest.NewSchema(t)
	b := &bundle{server: srv, schema: s, pool: s.Pool, taskQueue: "tq-" + randomHex(), spans: tracetest.NewSpanRecorder()}
	tel := &ledgerworker.Telemetry{
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(b.spans)),
		MeterProvider:  sdkmetric.NewMeterProvider(),
	}
	w, err := ledgerworker.Start(context.Background(), ledgerworker.Config{
		TemporalAddress: srv.Address,
		Namespace:       temporaltest.Namespace,
		TaskQueue:       b.taskQueue,
		DatabaseURL:     s.URL,
		Register:        register,
	}, tel)
	require.NoError(t, err)
	t.Cleanup(w.Stop)
	b.worker, b.client = w, w.Client
	require.NoError(t, activities.OpenAccounts(context.Background(), s.Pool, 1000, "alice", "bob"))
	return b
}

func (b *bundle) transfer(t *testing.T, req workflows.TransferRequest) (workflows.TransferResult, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	run, err := b.client.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: req.TransferID, TaskQueue: b.taskQueue}, workflows.TransferWorkflowName, req)
	require.NoError(t, err)
	var res workflows.TransferResult
	err = run.Get(ctx, &res)
	return res, err
}

func (b *bundle) count(t *testing.T, query string, args ...any) int64 {
	t.Helper()
	var n int64
	require.NoError(t, b.pool.QueryRow(context.Background(), query, args...).Scan(&n))
	return n
}

// entries counts the ledger entries of a transfer of one kind.
func (b *bundle) entries(t *testing.T, transferID, kind string) int64 {
	return b.count(t, `SELECT count(*) FROM ledger_entry WHERE transfer_id = $1 AND kind = $2`, transferID, kind)
}

// outcomes returns the dedup outcomes recorded for an activity type, in order.
func (b *bundle) outcomes(activityType string) []string {
	var out []string
	for _, s := range b.spans.Ended() {
		if s.Name() != "Dedup:"+activityType {
			continue
		}
		for _, kv := range s.Attributes() {
			if kv.Key == dedupactivity.OutcomeKey {
				out = append(out, kv.Value.AsString())
			}
		}
	}
	return out
}

func randomHex() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func clientTrigger() client.ScheduleTriggerOptions { return client.ScheduleTriggerOptions{} }
