// Command worker runs the example ledger worker: TransferWorkflow and the
// dedup-wrapped Debit and Credit activities.
//
// Configuration comes from the environment (defaults match docker-compose.yml):
//
//	TEMPORAL_ADDRESS    Temporal frontend host:port   (127.0.0.1:7233)
//	TEMPORAL_NAMESPACE  namespace                     (default)
//	TASK_QUEUE          task queue                    (ledger-transfers)
//	DATABASE_URL        PostgreSQL connection string  (postgres://postgres:postgres@127.0.0.1:5432/ledger?sslmode=disable)
//	OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, ...: the standard
//	OpenTelemetry variables; traces and metrics are exported over OTLP/gRPC
//	when an endpoint is set.
//
// It migrates the marker table and the ledger schema at start, and on SIGINT
// or SIGTERM stops polling, lets in-flight activities finish, and flushes
// spans before exiting.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
)

func main() {
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	tel, err := ledgerworker.TelemetryFromEnv(ctx, "ledger-worker")
	if err != nil {
		return err
	}
	if path := os.Getenv("DEDUP_COUNTS_FILE"); path != "" {
		// Used by the chaos harness: outcome counts, snapshotted to a file.
		tel.MeterProvider = ledgerworker.CountsToFile(ctx, path, 200*time.Millisecond)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tel.Shutdown(sctx); err != nil {
			log.Printf("flush telemetry: %v", err)
		}
	}()

	cfg := ledgerworker.ConfigFromEnv()
	w, err := ledgerworker.Start(ctx, cfg, tel)
	if err != nil {
		return err
	}
	log.Printf("worker polling task queue %q on %s (namespace %q)", cfg.TaskQueue, cfg.TemporalAddress, cfg.Namespace)
	<-ctx.Done()
	log.Printf("stopping: draining in-flight activities")
	w.Stop()
	fmt.Fprintln(os.Stderr, "worker stopped")
	return nil
}
