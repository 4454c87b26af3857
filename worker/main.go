// Command worker runs the example ledger worker: TransferWorkflow and the
// Debit and Credit activities, whose effects dedupactivity applies once per
// event.
//
// Configuration comes from the environment (defaults match docker-compose.yml):
//
//	TEMPORAL_ADDRESS    Temporal frontend host:port   (127.0.0.1:7233)
//	TEMPORAL_NAMESPACE  namespace                     (default)
//	TASK_QUEUE          task queue                    (ledger-transfers)
//	DATABASE_URL        PostgreSQL connection string  (postgres://postgres:postgres@127.0.0.1:5432/ledger?sslmode=disable)
//	RECEIPTS_URL        receipts service; when set, Credit sends a receipt through the outbox
//	METRICS_ADDR        serve /metrics for Prometheus here (say 127.0.0.1:9464)
//	PRUNE_INTERVAL      how often the prune Schedules run: markers, and settled outbox messages (1h; set at each start)
//	OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, ...: the standard
//	OpenTelemetry variables; traces and metrics go out over OTLP/gRPC when
//	an endpoint is set (another OTEL_EXPORTER_OTLP_PROTOCOL, or an
//	OTEL_*_EXPORTER other than otlp or none, stops it at start).
//	OUTBOX_RELAY_LEASE, DEDUP_COUNTS_FILE: for the chaos harness (a shorter
//	relay lease; the outcome counts written to a file).
//
// It needs a Temporal frontend and the ledger database at those addresses
// (make demo starts both for itself; by hand: bin/temporal server start-dev,
// and createdb ledger); it migrates the database at start.
//
// On SIGINT or SIGTERM it stops polling, lets in-flight activities finish,
// and flushes telemetry before exiting.
package main

import (
	"context"
	"fmt"
	"log"
	"time"

	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
	"github.com/dedupactivity/dedupactivity/workflows"
)

func main() {
	if err := run(context.Background()); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context) error {
	cfg, err := ledgerworker.ConfigFromEnv()
	if err != nil {
		return err
	}
	tel, err := ledgerworker.TelemetryFromEnv(ctx, "ledger-worker")
	if err != nil {
		return err
	}
	defer flush(tel)

	// PostgreSQL: a pool with a connection per concurrent activity, the
	// Deduper, and the marker table and ledger schema.
	pool, err := ledgerworker.OpenPool(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{TracerProvider: tel.TracerProvider, MeterProvider: tel.MeterProvider})
	if err != nil {
		return err
	}
	if err := ledgerworker.Migrate(ctx, d, pool); err != nil {
		return err
	}

	// Temporal: the client (with the tracing interceptor) and the worker.
	copts, err := ledgerworker.ClientOptions(cfg, tel)
	if err != nil {
		return err
	}
	c, err := ledgerworker.DialTemporal(ctx, time.Minute, copts) // while Temporal starts, as the migrations wait for PostgreSQL
	if err != nil {
		return fmt.Errorf("connect to Temporal at %s: %w", cfg.TemporalAddress, err)
	}
	defer c.Close()
	w := worker.New(c, cfg.TaskQueue, ledgerworker.WorkerOptions(cfg, pool))

	// Receipts through the outbox, when a receipts service is configured.
	var ob *outbox.Outbox
	var rc *outbox.Reconciler
	if cfg.ReceiptsURL != "" {
		relay, reconciler, err := ledgerworker.Receipts(ctx, cfg, pool, tel)
		if err != nil {
			return err
		}
		ob, rc = relay.Outbox(), reconciler
		outbox.RegisterRelay(w, relay)
		outbox.RegisterReconciler(w, rc)
		outbox.RegisterPruner(w, ob)
		// Stopped, and waited for, before the pool closes: a message in
		// flight is given back on the way out.
		relayCtx, stopRelay := context.WithCancel(ctx)
		relayDone := make(chan struct{})
		go func() { defer close(relayDone); _ = relay.Run(relayCtx) }()
		defer func() { stopRelay(); <-relayDone }()
	}

	// The workflow, the activities struct (Debit and Credit, their effects
	// wrapped by d) and the pruner.
	w.RegisterWorkflowWithOptions(workflows.TransferWorkflow, workflow.RegisterOptions{Name: workflows.TransferWorkflowName})
	w.RegisterActivity(activities.New(d, ob))
	dedupactivity.RegisterPruner(w, d)
	ledgerworker.WarnRedelivery(copts.Logger, cfg)
	if err := ledgerworker.Schedules(ctx, c, cfg, d, rc); err != nil {
		return err
	}

	log.Printf("worker polling task queue %q on %s (namespace %q)", cfg.TaskQueue, cfg.TemporalAddress, cfg.Namespace)
	return w.Run(worker.InterruptCh())
}

// flush sends the telemetry still buffered.
func flush(tel *ledgerworker.Telemetry) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := tel.Shutdown(ctx); err != nil {
		log.Printf("flush telemetry: %v", err)
	}
}
