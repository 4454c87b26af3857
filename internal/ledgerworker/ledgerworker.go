// Package ledgerworker wires the example ledger worker: configuration from the
// environment, PostgreSQL, migrations, the Temporal client with the
// OpenTelemetry tracing interceptor, and the registered workflows and wrapped
// activities. worker/main.go, the demo and the end-to-end tests share it.
package ledgerworker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetricgrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
	"go.temporal.io/sdk/client"
	temporalotel "go.temporal.io/sdk/contrib/opentelemetry"
	"go.temporal.io/sdk/interceptor"
	tlog "go.temporal.io/sdk/log"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/workflows"
)

// Defaults of Config, matching docker-compose.yml.
const (
	DefaultTemporalAddress = "127.0.0.1:7233"
	DefaultNamespace       = "default"
	DefaultTaskQueue       = "ledger-transfers"
	DefaultDatabaseURL     = "postgres://postgres:postgres@127.0.0.1:5432/ledger?sslmode=disable"
)

// Config configures the worker.
type Config struct {
	// TemporalAddress is the frontend host:port (env TEMPORAL_ADDRESS).
	TemporalAddress string
	// Namespace is the Temporal namespace (env TEMPORAL_NAMESPACE).
	Namespace string
	// TaskQueue is the task queue polled (env TASK_QUEUE).
	TaskQueue string
	// DatabaseURL is the PostgreSQL connection string (env DATABASE_URL).
	DatabaseURL string
	// Dedup configures the Deduper (TracerProvider and MeterProvider are
	// filled from the worker's).
	Dedup dedupactivity.Options
	// MaxConcurrentActivities caps concurrent activity executions. Every
	// attempt holds one pooled connection for its transaction, so the pool
	// is sized to this plus a margin (unless DatabaseURL sets
	// pool_max_conns). Defaults to 32.
	MaxConcurrentActivities int
	// Logger for the Temporal client; nil logs warnings and errors to stderr.
	Logger tlog.Logger
	// PruneInterval is how often the prune schedule runs (env
	// PRUNE_INTERVAL). Defaults to 1h.
	PruneInterval time.Duration
	// ReceiptsURL, when set, is the base URL of the receipts service
	// (internal/receipts; env RECEIPTS_URL): Credit then enqueues a receipt
	// in its transaction, a relay loop delivers it, and a reconcile schedule
	// settles what the relay cannot.
	ReceiptsURL string
	// Relay tunes the outbox relay (Sender and telemetry are filled in).
	Relay outbox.RelayConfig
	// Register, when set, registers more workflows and activities before
	// the worker starts (tests use it).
	Register func(r worker.Registry, d *dedupactivity.Deduper, pool *pgxpool.Pool)
}

// ConfigFromEnv reads Config from the environment, with the defaults above.
// OUTBOX_RELAY_LEASE sets Relay.Lease (the chaos harness shortens it so that
// a held send is taken over by another relay).
func ConfigFromEnv() Config {
	interval, _ := time.ParseDuration(os.Getenv("PRUNE_INTERVAL"))
	lease, _ := time.ParseDuration(os.Getenv("OUTBOX_RELAY_LEASE"))
	return Config{
		Relay:           outbox.RelayConfig{Lease: lease},
		PruneInterval:   interval,
		TemporalAddress: cmp.Or(os.Getenv("TEMPORAL_ADDRESS"), DefaultTemporalAddress),
		Namespace:       cmp.Or(os.Getenv("TEMPORAL_NAMESPACE"), DefaultNamespace),
		TaskQueue:       cmp.Or(os.Getenv("TASK_QUEUE"), DefaultTaskQueue),
		DatabaseURL:     cmp.Or(os.Getenv("DATABASE_URL"), DefaultDatabaseURL),
		ReceiptsURL:     os.Getenv("RECEIPTS_URL"),
	}
}

// Telemetry holds the providers the worker reports to, and their shutdown.
type Telemetry struct {
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	Shutdown       func(context.Context) error
}

// TelemetryFromEnv exports traces and metrics over OTLP/gRPC when the
// standard OTEL_EXPORTER_OTLP_ENDPOINT (or the _TRACES_/_METRICS_ variant) is
// set, unless OTEL_TRACES_EXPORTER or OTEL_METRICS_EXPORTER is "none";
// otherwise it uses the global (no-op) providers. The service name is
// OTEL_SERVICE_NAME, defaulting to serviceName.
func TelemetryFromEnv(ctx context.Context, serviceName string) (*Telemetry, error) {
	endpoint := os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT")
	traces := cmp.Or(os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), endpoint)
	metrics := cmp.Or(os.Getenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"), endpoint)
	// The standard switches: OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER=none.
	if os.Getenv("OTEL_TRACES_EXPORTER") == "none" {
		traces = ""
	}
	if os.Getenv("OTEL_METRICS_EXPORTER") == "none" {
		metrics = ""
	}
	t := &Telemetry{TracerProvider: otel.GetTracerProvider(), MeterProvider: otel.GetMeterProvider(), Shutdown: func(context.Context) error { return nil }}
	if traces == "" && metrics == "" {
		return t, nil
	}
	res, err := resource.Merge(resource.Default(), resource.NewWithAttributes(semconv.SchemaURL,
		semconv.ServiceName(cmp.Or(os.Getenv("OTEL_SERVICE_NAME"), serviceName))))
	if err != nil {
		return nil, fmt.Errorf("otel resource: %w", err)
	}
	var shutdowns []func(context.Context) error
	if traces != "" {
		exp, err := otlptracegrpc.New(ctx)
		if err != nil {
			return nil, fmt.Errorf("otlp trace exporter: %w", err)
		}
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
		t.TracerProvider = tp
		shutdowns = append(shutdowns, tp.Shutdown)
	}
	if metrics != "" {
		exp, err := otlpmetricgrpc.New(ctx)
		if err != nil {
			return nil, fmt.Errorf("otlp metric exporter: %w", err)
		}
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp)), sdkmetric.WithResource(res))
		t.MeterProvider = mp
		shutdowns = append(shutdowns, mp.Shutdown)
	}
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	t.Shutdown = func(ctx context.Context) error {
		var errs []error
		for _, s := range shutdowns {
			errs = append(errs, s(ctx))
		}
		return errors.Join(errs...)
	}
	return t, nil
}

// OpenPool opens a pool on cfg.DatabaseURL sized for
// cfg.MaxConcurrentActivities (unless the URL sets pool_max_conns).
func OpenPool(ctx context.Context, cfg Config) (*pgxpool.Pool, error) {
	poolCfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("parse DATABASE_URL: %w", err)
	}
	if !strings.Contains(cfg.DatabaseURL, "pool_max_conns") {
		poolCfg.MaxConns = int32(cmp.Or(cfg.MaxConcurrentActivities, 32) + 4)
	}
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	return pool, nil
}

// PruneScheduleID is the ID of the worker's prune schedule.
func PruneScheduleID(taskQueue string) string { return "dedup-prune-" + taskQueue }

// Worker is a started ledger worker.
type Worker struct {
	Client  client.Client
	Pool    *pgxpool.Pool
	Deduper *dedupactivity.Deduper
	Worker  worker.Worker
	// Outbox and Relay are set when Config.ReceiptsURL is.
	Outbox *outbox.Outbox
	Relay  *outbox.Relay

	stopRelay func()
}

// ReconcileScheduleID is the ID of the worker's outbox reconcile schedule.
func ReconcileScheduleID(taskQueue string) string { return "outbox-reconcile-" + taskQueue }

// Start connects to PostgreSQL and Temporal, migrates, registers the
// workflows and wrapped activities and starts polling.
func Start(ctx context.Context, cfg Config, tel *Telemetry) (_ *Worker, err error) {
	if tel == nil {
		tel = &Telemetry{TracerProvider: otel.GetTracerProvider(), MeterProvider: otel.GetMeterProvider()}
	}
	cfg.MaxConcurrentActivities = cmp.Or(cfg.MaxConcurrentActivities, 32)
	pool, err := OpenPool(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			pool.Close()
		}
	}()
	opts := cfg.Dedup
	opts.TracerProvider, opts.MeterProvider = tel.TracerProvider, tel.MeterProvider
	d, err := dedupactivity.New(pool, opts)
	if err != nil {
		return nil, err
	}
	if err := d.Migrate(ctx); err != nil {
		return nil, fmt.Errorf("migrate markers: %w", err)
	}
	if err := activities.Migrate(ctx, pool); err != nil {
		return nil, fmt.Errorf("migrate ledger: %w", err)
	}

	tracing, err := temporalotel.NewTracingInterceptor(temporalotel.TracerOptions{
		Tracer: tel.TracerProvider.Tracer("temporal-sdk-go"),
	})
	if err != nil {
		return nil, fmt.Errorf("tracing interceptor: %w", err)
	}
	logger := cfg.Logger
	if logger == nil {
		logger = QuietLogger()
	}
	c, err := client.Dial(client.Options{
		HostPort:     cfg.TemporalAddress,
		Namespace:    cfg.Namespace,
		Interceptors: []interceptor.ClientInterceptor{tracing},
		Logger:       logger,
	})
	if err != nil {
		return nil, fmt.Errorf("connect to Temporal at %s: %w", cfg.TemporalAddress, err)
	}
	w := worker.New(c, cfg.TaskQueue, worker.Options{
		MaxConcurrentActivityExecutionSize: cfg.MaxConcurrentActivities,
		WorkerStopTimeout:                  10 * time.Second,
	})
	w.RegisterWorkflowWithOptions(workflows.TransferWorkflow, workflow.RegisterOptions{Name: workflows.TransferWorkflowName})
	var relay *outbox.Relay
	var rc *outbox.Reconciler
	if cfg.ReceiptsURL != "" {
		if relay, rc, err = outboxFor(ctx, cfg, pool, tel); err != nil {
			c.Close()
			return nil, err
		}
		outbox.RegisterRelay(w, relay)
		outbox.RegisterReconciler(w, rc)
	}
	var ob *outbox.Outbox
	if relay != nil {
		ob = relay.Outbox()
	}
	acts := activities.New(d, ob)
	w.RegisterActivity(acts)
	dedupactivity.RegisterPruner(w, d)
	for _, name := range []string{activities.DebitName, activities.CreditName} {
		if warning := dedupactivity.RedeliveryWarning(name, workflows.ActivityOptions(0), cmp.Or(cfg.Dedup.Retention, dedupactivity.DefaultRetention)); warning != "" {
			logger.Warn("dedup retention does not cover redelivery", "warning", warning)
		}
	}
	if cfg.Register != nil {
		cfg.Register(w, d, pool)
	}
	if err := w.Start(); err != nil {
		c.Close()
		return nil, fmt.Errorf("start worker: %w", err)
	}
	if err := dedupactivity.EnsurePruneSchedule(ctx, c, d, PruneScheduleID(cfg.TaskQueue), cfg.TaskQueue, cmp.Or(cfg.PruneInterval, time.Hour)); err != nil {
		w.Stop()
		c.Close()
		return nil, err
	}
	out := &Worker{Client: c, Pool: pool, Deduper: d, Worker: w, stopRelay: func() {}}
	if relay != nil {
		if err := outbox.EnsureReconcileSchedule(ctx, c, rc, ReconcileScheduleID(cfg.TaskQueue), cfg.TaskQueue, time.Minute); err != nil {
			w.Stop()
			c.Close()
			return nil, err
		}
		relayCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		done := make(chan struct{})
		go func() { defer close(done); _ = relay.Run(relayCtx) }()
		out.Outbox, out.Relay = relay.Outbox(), relay
		out.stopRelay = func() { cancel(); <-done }
	}
	return out, nil
}

// outboxFor migrates the outbox and builds the relay and reconciler for the
// receipts service at cfg.ReceiptsURL.
func outboxFor(ctx context.Context, cfg Config, pool *pgxpool.Pool, tel *Telemetry) (*outbox.Relay, *outbox.Reconciler, error) {
	ob, err := outbox.New(pool, outbox.Options{})
	if err != nil {
		return nil, nil, err
	}
	if err := ob.Migrate(ctx); err != nil {
		return nil, nil, fmt.Errorf("migrate outbox: %w", err)
	}
	base := strings.TrimSuffix(cfg.ReceiptsURL, "/")
	sender, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{
		Endpoints: map[string]string{activities.ReceiptsDestination: base + "/receipts"},
		Timeout:   5 * time.Second,
	})
	if err != nil {
		return nil, nil, err
	}
	rcfg := cfg.Relay
	rcfg.Sender = sender
	rcfg.TracerProvider, rcfg.MeterProvider = tel.TracerProvider, tel.MeterProvider
	rcfg.PollInterval = cmp.Or(rcfg.PollInterval, 200*time.Millisecond)
	rcfg.MinBackoff = cmp.Or(rcfg.MinBackoff, 200*time.Millisecond)
	rcfg.MaxBackoff = cmp.Or(rcfg.MaxBackoff, 5*time.Second)
	rcfg.Lease = cmp.Or(rcfg.Lease, 15*time.Second)
	relay, err := outbox.NewRelay(ob, rcfg)
	if err != nil {
		return nil, nil, err
	}
	rc, err := outbox.NewReconciler(ob, outbox.ReconcilerConfig{
		Checker:        outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{activities.ReceiptsDestination: base + "/idempotency-keys"})},
		UnackedAfter:   30 * time.Second,
		TracerProvider: tel.TracerProvider,
		MeterProvider:  tel.MeterProvider,
	})
	if err != nil {
		return nil, nil, err
	}
	return relay, rc, nil
}

// Stop drains the worker (in-flight activities finish, up to its stop
// timeout) and closes the client and pool.
func (w *Worker) Stop() {
	w.Worker.Stop()
	if w.stopRelay != nil {
		w.stopRelay()
	}
	w.Client.Close()
	w.Pool.Close()
}
