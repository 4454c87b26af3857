package ledgerworker_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	temporalotel "go.temporal.io/sdk/contrib/opentelemetry"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
)

// TestConfigFromEnvDurations: a duration that does not parse stops the
// worker at start with the variable's name, instead of passing for the
// default; unset is the default, and a valid one is taken.
func TestConfigFromEnvDurations(t *testing.T) {
	for _, name := range []string{"PRUNE_INTERVAL", "OUTBOX_RELAY_LEASE"} {
		t.Setenv(name, "hourly")
		_, err := ledgerworker.ConfigFromEnv()
		require.ErrorContains(t, err, name)
		t.Setenv(name, "")
	}
	cfg, err := ledgerworker.ConfigFromEnv()
	require.NoError(t, err)
	require.Zero(t, cfg.PruneInterval, "unset: the default applies later")
	t.Setenv("PRUNE_INTERVAL", "2h")
	t.Setenv("OUTBOX_RELAY_LEASE", "5s")
	cfg, err = ledgerworker.ConfigFromEnv()
	require.NoError(t, err)
	require.Equal(t, 2*time.Hour, cfg.PruneInterval)
	require.Equal(t, 5*time.Second, cfg.Relay.Lease)
}

// TestStartRefusesTemporalMetricsBesideTheOTelHandler: the worker's SDK
// metrics handler is the SDK's OpenTelemetry one on its MeterProvider, which
// the Deduper records to; Dedup.TemporalMetrics would export every dedup
// metric a second time, under the SDK's scope. Start refuses it before it
// connects anywhere.
func TestStartRefusesTemporalMetricsBesideTheOTelHandler(t *testing.T) {
	t.Parallel()
	mp := sdkmetric.NewMeterProvider()
	tel := &ledgerworker.Telemetry{
		TracerProvider: tracenoop.NewTracerProvider(), MeterProvider: mp,
		SDKMetrics: temporalotel.NewMetricsHandler(temporalotel.MetricsHandlerOptions{Meter: mp.Meter("temporal-sdk-go")}),
	}
	_, err := ledgerworker.Start(context.Background(), ledgerworker.Config{
		DatabaseURL: "postgres://127.0.0.1:1/db", Dedup: dedupactivity.Options{TemporalMetrics: true},
	}, tel)
	require.ErrorContains(t, err, "twice")
}

// TestWorkerOptionsFitThePool: every activity attempt holds a pooled
// connection for its transaction (a duplicate for up to the claim wait), so
// the worker runs no more activities at once than its pool serves beside
// the relay and the gauges: a DATABASE_URL that sets pool_max_conns below
// the default concurrency lowers the concurrency with it, instead of
// leaving attempts waiting for a connection against their StartToClose.
func TestWorkerOptionsFitThePool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, tc := range []struct {
		url  string
		want int
	}{
		{"postgres://127.0.0.1:1/db", 32},
		{"postgres://127.0.0.1:1/db?pool_max_conns=10", 6},
		{"postgres://127.0.0.1:1/db?pool_max_conns=100", 32},
		{"postgres://127.0.0.1:1/db?pool_max_conns=2", 1},
	} {
		cfg := ledgerworker.Config{DatabaseURL: tc.url}
		pool, err := ledgerworker.OpenPool(ctx, cfg) // connects lazily
		require.NoError(t, err)
		require.Equal(t, tc.want, ledgerworker.WorkerOptions(cfg, pool).MaxConcurrentActivityExecutionSize, tc.url)
		pool.Close()
	}
}

// TestTelemetryFromEnvRefusesWhatItDoesNotExport: the worker exports over
// OTLP/gRPC only. A standard OTEL_ variable asking for another protocol or
// exporter stops it at start with the variable's name, instead of sending
// gRPC to an OTLP/HTTP port (or nothing to a console) without a word.
func TestTelemetryFromEnvRefusesWhatItDoesNotExport(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
	for _, tc := range [][2]string{
		{"OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"},
		{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"},
		{"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf"},
		{"OTEL_TRACES_EXPORTER", "console"},
		{"OTEL_METRICS_EXPORTER", "prometheus"},
	} {
		t.Setenv(tc[0], tc[1])
		_, err := ledgerworker.TelemetryFromEnv(context.Background(), "test")
		require.ErrorContains(t, err, tc[0])
		t.Setenv(tc[0], "")
	}
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	t.Setenv("OTEL_TRACES_EXPORTER", "otlp")
	t.Setenv("OTEL_METRICS_EXPORTER", "none")
	tel, err := ledgerworker.TelemetryFromEnv(context.Background(), "test")
	require.NoError(t, err)
	require.NoError(t, tel.Shutdown(context.Background()))
}

// TestConfigFromEnvRefusesNonPositiveDurations: a zero or negative
// PRUNE_INTERVAL or OUTBOX_RELAY_LEASE is an error naming the variable at
// start, not the default (zero) or a failure after migrating, from the
// Schedule or the relay, that names neither.
func TestConfigFromEnvRefusesNonPositiveDurations(t *testing.T) {
	for _, name := range []string{"PRUNE_INTERVAL", "OUTBOX_RELAY_LEASE"} {
		for _, v := range []string{"0", "0s", "-1h"} {
			t.Setenv(name, v)
			_, err := ledgerworker.ConfigFromEnv()
			require.ErrorContains(t, err, name, v)
		}
		t.Setenv(name, "")
	}
}
