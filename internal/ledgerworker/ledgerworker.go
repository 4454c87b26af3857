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
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetricgrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
	"go.temporal.io/api/serviceerror"
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
	// is sized to this plus a margin; when DatabaseURL sets pool_max_conns,
	// the cap is lowered to what that pool serves beside the margin (see
	// WorkerOptions). Defaults to 32.
	MaxConcurrentActivities int
	// Logger for the Temporal client; nil logs warnings and errors to stderr.
	Logger tlog.Logger
	// PruneInterval is how often the prune schedules run (env
	// PRUNE_INTERVAL), set at each start on schedules made earlier too.
	// Defaults to 1h.
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
// a held send is taken over by another relay). A duration that does not
// parse, or is not positive, is an error, not the default.
func ConfigFromEnv() (Config, error) {
	interval, err := envDuration("PRUNE_INTERVAL")
	if err != nil {
		return Config{}, err
	}
	lease, err := envDuration("OUTBOX_RELAY_LEASE")
	if err != nil {
		return Config{}, err
	}
	return Config{
		Relay:           outbox.RelayConfig{Lease: lease},
		PruneInterval:   interval,
		TemporalAddress: cmp.Or(os.Getenv("TEMPORAL_ADDRESS"), DefaultTemporalAddress),
		Namespace:       cmp.Or(os.Getenv("TEMPORAL_NAMESPACE"), DefaultNamespace),
		TaskQueue:       cmp.Or(os.Getenv("TASK_QUEUE"), DefaultTaskQueue),
		DatabaseURL:     cmp.Or(os.Getenv("DATABASE_URL"), DefaultDatabaseURL),
		ReceiptsURL:     os.Getenv("RECEIPTS_URL"),
	}, nil
}

// envDuration is the duration in the environment variable name; 0 when it
// is unset or empty. A set one must be positive: 0 would stand for the
// default.
func envDuration(name string) (time.Duration, error) {
	v := os.Getenv(name)
	if v == "" {
		return 0, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", name, err)
	}
	if d <= 0 {
		return 0, fmt.Errorf("%s: %q is not a positive duration (unset it for the default)", name, v)
	}
	return d, nil
}

// Telemetry holds the providers the worker reports to, and their shutdown.
type Telemetry struct {
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	// SDKMetrics, when set, is the Temporal client's MetricsHandler, so the
	// SDK's own metrics (activity_type, namespace, task_queue) land beside
	// the dedup metrics.
	SDKMetrics client.MetricsHandler
	// MetricsAddr is where /metrics is served for Prometheus (host:port),
	// when TelemetryConfig.MetricsAddr was set.
	MetricsAddr string
	Shutdown    func(context.Context) error
}

// TelemetryConfig says where the worker's telemetry goes.
type TelemetryConfig struct {
	// ServiceName is the OpenTelemetry service.name.
	ServiceName string
	// TracesEndpoint is an OTLP/gRPC URL (http://127.0.0.1:4317) for spans;
	// "env" uses the standard OTEL_EXPORTER_OTLP_* variables. Empty: none.
	TracesEndpoint string
	// MetricsEndpoint is the same for metrics pushed over OTLP.
	MetricsEndpoint string
	// MetricsAddr, when set, serves the metrics for Prometheus at
	// http://MetricsAddr/metrics (OpenMetrics, with exemplars); port 0
	// picks a free port (see Telemetry.MetricsAddr).
	MetricsAddr string
}

// TelemetryFromEnv exports traces and metrics over OTLP/gRPC when the
// standard OTEL_EXPORTER_OTLP_ENDPOINT (or the _TRACES_/_METRICS_ variant) is
// set, unless OTEL_TRACES_EXPORTER or OTEL_METRICS_EXPORTER is "none", and
// serves metrics for Prometheus on METRICS_ADDR (say 127.0.0.1:9464) when set;
// otherwise it uses the global (no-op) providers. The service name is
// OTEL_SERVICE_NAME, defaulting to serviceName. DEDUP_COUNTS_FILE (set by
// the chaos harness) snapshots the dedup outcome counts to that file. An
// OTEL_EXPORTER_OTLP_*PROTOCOL other than grpc, or an OTEL_*_EXPORTER other
// than otlp or none, is an error: the worker exports nothing else.
func TelemetryFromEnv(ctx context.Context, serviceName string) (*Telemetry, error) {
	for _, name := range []string{"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"} {
		if v := os.Getenv(name); v != "" && v != "grpc" {
			return nil, fmt.Errorf("%s=%q: the worker exports over OTLP/gRPC only (grpc)", name, v)
		}
	}
	for _, name := range []string{"OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"} {
		if v := os.Getenv(name); v != "" && v != "otlp" && v != "none" {
			return nil, fmt.Errorf("%s=%q: the worker exports over OTLP/gRPC (otlp) or not at all (none); for Prometheus, set METRICS_ADDR", name, v)
		}
	}
	endpoint := os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT")
	cfg := TelemetryConfig{
		ServiceName: cmp.Or(os.Getenv("OTEL_SERVICE_NAME"), serviceName),
		MetricsAddr: os.Getenv("METRICS_ADDR"),
	}
	if cmp.Or(os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), endpoint) != "" && os.Getenv("OTEL_TRACES_EXPORTER") != "none" {
		cfg.TracesEndpoint = "env"
	}
	if cmp.Or(os.Getenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"), endpoint) != "" && os.Getenv("OTEL_METRICS_EXPORTER") != "none" {
		cfg.MetricsEndpoint = "env"
	}
	t, err := NewTelemetry(ctx, cfg)
	if err == nil && os.Getenv("DEDUP_COUNTS_FILE") != "" {
		t.MeterProvider = CountsToFile(ctx, os.Getenv("DEDUP_COUNTS_FILE"), 200*time.Millisecond)
	}
	return t, err
}

// NewTelemetry builds the providers cfg asks for; with nothing configured
// it returns the global (no-op) providers.
func NewTelemetry(ctx context.Context, cfg TelemetryConfig) (*Telemetry, error) {
	t := &Telemetry{TracerProvider: otel.GetTracerProvider(), MeterProvider: otel.GetMeterProvider(), Shutdown: func(context.Context) error { return nil }}
	if cfg.TracesEndpoint == "" && cfg.MetricsEndpoint == "" && cfg.MetricsAddr == "" {
		return t, nil
	}
	// Schemaless: resource.Default() carries the SDK's own schema URL, and
	// merging two different ones fails.
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(semconv.ServiceName(cfg.ServiceName)))
	if err != nil {
		return nil, fmt.Errorf("otel resource: %w", err)
	}
	var shutdowns []func(context.Context) error
	if cfg.TracesEndpoint != "" {
		var opts []otlptracegrpc.Option
		if cfg.TracesEndpoint != "env" {
			opts = append(opts, otlptracegrpc.WithEndpointURL(cfg.TracesEndpoint))
		}
		exp, err := otlptracegrpc.New(ctx, opts...)
		if err != nil {
			return nil, fmt.Errorf("otlp trace exporter: %w", err)
		}
		tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
		t.TracerProvider = tp
		shutdowns = append(shutdowns, tp.Shutdown)
	}
	var readers []sdkmetric.Option
	if cfg.MetricsEndpoint != "" {
		var opts []otlpmetricgrpc.Option
		if cfg.MetricsEndpoint != "env" {
			opts = append(opts, otlpmetricgrpc.WithEndpointURL(cfg.MetricsEndpoint))
		}
		exp, err := otlpmetricgrpc.New(ctx, opts...)
		if err != nil {
			return nil, fmt.Errorf("otlp metric exporter: %w", err)
		}
		readers = append(readers, sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp)))
	}
	if cfg.MetricsAddr != "" {
		reg := prometheus.NewRegistry()
		exp, err := otelprom.New(otelprom.WithRegisterer(reg))
		if err != nil {
			return nil, fmt.Errorf("prometheus exporter: %w", err)
		}
		readers = append(readers, sdkmetric.WithReader(exp))
		ln, err := net.Listen("tcp", cfg.MetricsAddr)
		if err != nil {
			return nil, fmt.Errorf("serve metrics: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{EnableOpenMetrics: true}))
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		t.MetricsAddr = ln.Addr().String()
		shutdowns = append(shutdowns, srv.Shutdown)
	}
	if len(readers) > 0 {
		mp := sdkmetric.NewMeterProvider(append(readers, sdkmetric.WithResource(res))...)
		t.MeterProvider = mp
		t.SDKMetrics = temporalotel.NewMetricsHandler(temporalotel.MetricsHandlerOptions{
			Meter:                mp.Meter("temporal-sdk-go"),
			UseMonotonicCounters: true,
			OnError:              func(err error) { otel.Handle(err) }, // the default panics
		})
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
		poolCfg.MaxConns = int32(cmp.Or(cfg.MaxConcurrentActivities, 32) + poolMargin)
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
	// Outbox, Relay and Reconciler are set when Config.ReceiptsURL is.
	Outbox     *outbox.Outbox
	Relay      *outbox.Relay
	Reconciler *outbox.Reconciler

	stopRelay func()
}

// ReconcileScheduleID is the ID of the worker's outbox reconcile schedule.
func ReconcileScheduleID(taskQueue string) string { return "outbox-reconcile-" + taskQueue }

// OutboxPruneScheduleID is the ID of the worker's outbox prune schedule.
func OutboxPruneScheduleID(taskQueue string) string { return "outbox-prune-" + taskQueue }

// ScheduleIDs are the IDs of every Schedule that Schedules may create for
// taskQueue, for a caller that deletes them with its task queue.
func ScheduleIDs(taskQueue string) []string {
	return []string{PruneScheduleID(taskQueue), OutboxPruneScheduleID(taskQueue), ReconcileScheduleID(taskQueue)}
}

// Migrate creates the marker table and the ledger schema, retrying with
// backoff while the database restarts or fails over (see Retry).
func Migrate(ctx context.Context, d *dedupactivity.Deduper, pool *pgxpool.Pool) error {
	if err := Retry(ctx, time.Minute, d.Migrate); err != nil {
		return fmt.Errorf("migrate markers: %w", err)
	}
	if err := Retry(ctx, time.Minute, func(ctx context.Context) error { return activities.Migrate(ctx, pool) }); err != nil {
		return fmt.Errorf("migrate ledger: %w", err)
	}
	return nil
}

// ClientOptions are the Temporal client's options: the address and
// namespace of cfg, the OpenTelemetry tracing interceptor (so each
// activity's RunActivity span is the parent of its Dedup span), and the
// SDK's metrics through tel.
func ClientOptions(cfg Config, tel *Telemetry) (client.Options, error) {
	tracing, err := temporalotel.NewTracingInterceptor(temporalotel.TracerOptions{
		Tracer: tel.TracerProvider.Tracer("temporal-sdk-go"),
	})
	if err != nil {
		return client.Options{}, fmt.Errorf("tracing interceptor: %w", err)
	}
	return client.Options{
		HostPort:       cfg.TemporalAddress,
		Namespace:      cfg.Namespace,
		Interceptors:   []interceptor.ClientInterceptor{tracing},
		Logger:         cmp.Or[tlog.Logger](cfg.Logger, QuietLogger()),
		MetricsHandler: tel.SDKMetrics, // nil: the SDK's no-op handler
	}, nil
}

// poolMargin is how many of the pool's connections OpenPool keeps beside
// the activities' own: the outbox relay and the gauges' queries.
const poolMargin = 4

// WorkerOptions caps concurrent activities at what pool can serve (each
// attempt holds a connection for its transaction, a duplicate for up to the
// claim wait): cfg.MaxConcurrentActivities, lowered to the pool's
// MaxConns less poolMargin (at least 1) when DatabaseURL set a smaller
// pool_max_conns, so that no attempt waits for a connection against its
// StartToClose.
func WorkerOptions(cfg Config, pool *pgxpool.Pool) worker.Options {
	return worker.Options{
		MaxConcurrentActivityExecutionSize: max(1, min(cmp.Or(cfg.MaxConcurrentActivities, 32), int(pool.Config().MaxConns)-poolMargin)),
		WorkerStopTimeout:                  10 * time.Second,
	}
}

// Start connects to PostgreSQL and Temporal, migrates, registers the
// workflows and wrapped activities and starts polling: worker/main.go's
// steps, for the demo and the tests, which run the worker in-process.
func Start(ctx context.Context, cfg Config, tel *Telemetry) (_ *Worker, err error) {
	if tel == nil {
		tel = &Telemetry{TracerProvider: otel.GetTracerProvider(), MeterProvider: otel.GetMeterProvider()}
	}
	if cfg.Dedup.TemporalMetrics && tel.SDKMetrics != nil {
		// tel.SDKMetrics is the SDK's OpenTelemetry handler on
		// tel.MeterProvider, which the Deduper records to already.
		return nil, errors.New("ledgerworker: Dedup.TemporalMetrics with the SDK's OpenTelemetry metrics handler on the same MeterProvider exports every dedup metric twice (see Options.TemporalMetrics): leave it unset")
	}
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
	if err := Migrate(ctx, d, pool); err != nil {
		return nil, err
	}
	copts, err := ClientOptions(cfg, tel)
	if err != nil {
		return nil, err
	}
	c, err := DialTemporal(ctx, time.Minute, copts)
	if err != nil {
		return nil, fmt.Errorf("connect to Temporal at %s: %w", cfg.TemporalAddress, err)
	}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	w := worker.New(c, cfg.TaskQueue, WorkerOptions(cfg, pool))
	var (
		relay *outbox.Relay
		rc    *outbox.Reconciler
		ob    *outbox.Outbox
	)
	if cfg.ReceiptsURL != "" {
		if relay, rc, err = Receipts(ctx, cfg, pool, tel); err != nil {
			return nil, err
		}
		ob = relay.Outbox()
		outbox.RegisterRelay(w, relay)
		outbox.RegisterReconciler(w, rc)
		outbox.RegisterPruner(w, ob)
	}
	w.RegisterWorkflowWithOptions(workflows.TransferWorkflow, workflow.RegisterOptions{Name: workflows.TransferWorkflowName})
	w.RegisterActivity(activities.New(d, ob))
	dedupactivity.RegisterPruner(w, d)
	WarnRedelivery(copts.Logger, cfg)
	if cfg.Register != nil {
		cfg.Register(w, d, pool)
	}
	if err := w.Start(); err != nil {
		return nil, fmt.Errorf("start worker: %w", err)
	}
	if err := Schedules(ctx, c, cfg, d, rc); err != nil {
		w.Stop()
		return nil, err
	}
	out := &Worker{Client: c, Pool: pool, Deduper: d, Worker: w, stopRelay: func() {}}
	if relay != nil {
		relayCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		done := make(chan struct{})
		go func() { defer close(done); _ = relay.Run(relayCtx) }()
		out.Outbox, out.Relay, out.Reconciler = relay.Outbox(), relay, rc
		out.stopRelay = func() { cancel(); <-done }
	}
	return out, nil
}

// WarnRedelivery logs when the Deduper's retention does not cover how long
// Temporal may redeliver the example's activities.
func WarnRedelivery(logger tlog.Logger, cfg Config) {
	for _, a := range []struct {
		name string
		opts workflow.ActivityOptions
	}{{activities.DebitName, workflows.ActivityOptions(0)}, {activities.CreditName, workflows.CreditActivityOptions(0)}} {
		if warning := dedupactivity.RedeliveryWarning(a.name, a.opts, cmp.Or(cfg.Dedup.Retention, dedupactivity.DefaultRetention)); warning != "" {
			logger.Warn("dedup retention does not cover redelivery", "warning", warning)
		}
	}
}

// Schedules creates (or gives the current interval to) the Temporal Schedules that prune markers
// and (with the receipts outbox, rc not nil) reconcile and prune the
// outbox.
func Schedules(ctx context.Context, c client.Client, cfg Config, d *dedupactivity.Deduper, rc *outbox.Reconciler) error {
	prune := cmp.Or(cfg.PruneInterval, time.Hour)
	if err := dedupactivity.EnsurePruneSchedule(ctx, c, d, PruneScheduleID(cfg.TaskQueue), cfg.TaskQueue, prune); err != nil {
		return err
	}
	if rc == nil {
		return nil
	}
	if err := outbox.EnsurePruneSchedule(ctx, c, rc.Outbox(), OutboxPruneScheduleID(cfg.TaskQueue), cfg.TaskQueue, prune); err != nil {
		return err
	}
	return outbox.EnsureReconcileSchedule(ctx, c, rc, ReconcileScheduleID(cfg.TaskQueue), cfg.TaskQueue, time.Minute)
}

// Receipts migrates the outbox and builds the relay and reconciler for the
// receipts service at cfg.ReceiptsURL.
func Receipts(ctx context.Context, cfg Config, pool *pgxpool.Pool, tel *Telemetry) (*outbox.Relay, *outbox.Reconciler, error) {
	ob, err := outbox.New(pool, outbox.Options{MeterProvider: tel.MeterProvider})
	if err != nil {
		return nil, nil, err
	}
	if err := Retry(ctx, time.Minute, ob.Migrate); err != nil {
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
		Destinations:   []string{activities.ReceiptsDestination}, // its series from zero: the first rejection shows
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

// Retry runs fn until it succeeds, fails with an error a retry cannot fix,
// ctx ends, or giveUp has passed, backing off from 100ms to 5s between
// tries. Errors worth a retry are the connection's (refused, reset, closed)
// and the server's own shutdown, start-up and fail-over states (SQLSTATE
// classes 08 and 57P, and 25006 on a standby about to be promoted).
func Retry(ctx context.Context, giveUp time.Duration, fn func(context.Context) error) error {
	return retry(ctx, giveUp, fn, transient)
}

// DialTemporal connects to Temporal, retrying as Retry does while the
// server does not answer (started after the worker, restarting), until
// giveUp has passed. Each failed try is logged through opts.Logger, so a
// wrong address or TLS setting, which looks the same, shows before giveUp.
func DialTemporal(ctx context.Context, giveUp time.Duration, opts client.Options) (client.Client, error) {
	unanswered := func(err error) bool {
		var unavailable *serviceerror.Unavailable
		var deadline *serviceerror.DeadlineExceeded
		return errors.As(err, &unavailable) || errors.As(err, &deadline)
	}
	var c client.Client
	err := retry(ctx, giveUp, func(ctx context.Context) (err error) {
		c, err = client.DialContext(ctx, opts)
		if err != nil && unanswered(err) && opts.Logger != nil {
			opts.Logger.Warn("Temporal does not answer yet; dialling again", "address", opts.HostPort, "error", err)
		}
		return err
	}, unanswered)
	return c, err
}

func retry(ctx context.Context, giveUp time.Duration, fn func(context.Context) error, transient func(error) bool) error {
	deadline := time.Now().Add(giveUp)
	wait := 100 * time.Millisecond
	for {
		err := fn(ctx)
		if err == nil || !transient(err) || time.Now().Add(wait).After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}

func transient(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// 55P03: a migration's lock wait ran out (Migrate bounds it).
		return strings.HasPrefix(pgErr.Code, "08") || strings.HasPrefix(pgErr.Code, "57P") || pgErr.Code == "25006" || pgErr.Code == "55P03"
	}
	var netErr net.Error
	var connectErr *pgconn.ConnectError
	return errors.As(err, &netErr) || errors.As(err, &connectErr) || pgconn.SafeToRetry(err) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}
