package ledgerworker_test

import (
	"net"
	"net/url"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"

	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
)

type compose struct {
	Services map[string]struct {
		Image       string            `yaml:"image"`
		Environment map[string]string `yaml:"environment"`
		Ports       []string          `yaml:"ports"`
		Volumes     []string          `yaml:"volumes"`
		Command     []string          `yaml:"command"`
		Healthcheck *struct {
			Test []string `yaml:"test"`
		} `yaml:"healthcheck"`
		DependsOn map[string]struct {
			Condition string `yaml:"condition"`
		} `yaml:"depends_on"`
	} `yaml:"services"`
}

// TestComposeMatchesWorkerDefaults parses docker-compose.yml (no Docker
// engine runs here) and checks that its ports are bound to 127.0.0.1 and
// agree with the worker's defaults.
func TestComposeMatchesWorkerDefaults(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../docker-compose.yml")
	require.NoError(t, err)
	var c compose
	require.NoError(t, yaml.Unmarshal(raw, &c))

	published := map[string]string{} // host port -> service
	for name, svc := range c.Services {
		require.NotEmpty(t, svc.Image, name)
		for _, p := range svc.Ports {
			parts := strings.Split(p, ":")
			require.Len(t, parts, 3, "%s: port %q must name the host address", name, p)
			require.Equal(t, "127.0.0.1", parts[0], "%s: port %q must bind to 127.0.0.1", name, p)
			published[parts[1]] = name
		}
	}

	db, err := url.Parse(ledgerworker.DefaultDatabaseURL)
	require.NoError(t, err)
	pg := c.Services[published[db.Port()]]
	require.Equal(t, "postgres", published[db.Port()])
	pass, _ := db.User.Password()
	require.Equal(t, db.User.Username(), pg.Environment["POSTGRES_USER"])
	require.Equal(t, pass, pg.Environment["POSTGRES_PASSWORD"])
	require.Equal(t, strings.TrimPrefix(db.Path, "/"), pg.Environment["POSTGRES_DB"])
	require.Equal(t, "127.0.0.1", db.Hostname())

	host, port, err := net.SplitHostPort(ledgerworker.DefaultTemporalAddress)
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1", host)
	require.Equal(t, "temporal", published[port])
	require.Equal(t, ledgerworker.DefaultNamespace, c.Services["temporal-create-namespace"].Environment["NAMESPACE"])

	require.Equal(t, "jaeger", published["4317"], "OTLP gRPC for OTEL_EXPORTER_OTLP_ENDPOINT")
	require.Equal(t, "jaeger", published["16686"], "Jaeger UI")
	require.Equal(t, "temporal-ui", published["8080"])
	require.Equal(t, "grafana", published["3000"])
	require.Equal(t, "prometheus", published["9090"])
}

// TestComposeWiring checks the stack's wiring without a Docker engine: every
// endpoint the worker is given names a service of the stack on a port it
// listens on, Prometheus scrapes the worker's METRICS_ADDR and has its rule
// files mounted, Grafana mounts
// the dashboard and its provisioning, the images are current (no
// auto-setup, Jaeger v2), and the UI and worker wait on health checks.
func TestComposeWiring(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../docker-compose.yml")
	require.NoError(t, err)
	var c compose
	require.NoError(t, yaml.Unmarshal(raw, &c))
	// containerPort is the port a service listens on inside the network.
	containerPort := map[string]map[string]bool{
		"postgres": {"5432": true}, "temporal": {"7233": true}, "jaeger": {"4317": true, "4318": true, "16686": true},
		"prometheus": {"9090": true}, "receipts": {"8081": true},
	}
	hostPort := func(name, hp string) {
		t.Helper()
		host, port, err := net.SplitHostPort(hp)
		require.NoError(t, err, "%s: %q", name, hp)
		require.Contains(t, c.Services, host, "%s names service %q", name, host)
		require.True(t, containerPort[host][port], "%s: %s listens on %s", name, host, port)
	}
	worker := c.Services["worker"]
	hostPort("TEMPORAL_ADDRESS", worker.Environment["TEMPORAL_ADDRESS"])
	db, err := url.Parse(worker.Environment["DATABASE_URL"])
	require.NoError(t, err)
	hostPort("DATABASE_URL", db.Host)
	pass, _ := db.User.Password()
	require.Equal(t, c.Services["postgres"].Environment["POSTGRES_PASSWORD"], pass)
	require.Equal(t, c.Services["postgres"].Environment["POSTGRES_DB"], strings.TrimPrefix(db.Path, "/"))
	otlp, err := url.Parse(worker.Environment["OTEL_EXPORTER_OTLP_ENDPOINT"])
	require.NoError(t, err)
	hostPort("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.Host)
	require.Equal(t, ledgerworker.DefaultNamespace, worker.Environment["TEMPORAL_NAMESPACE"])

	// The outbox's destination: the receipts service, listening where
	// RECEIPTS_URL points, on the database receipts-db creates.
	receiptsURL, err := url.Parse(worker.Environment["RECEIPTS_URL"])
	require.NoError(t, err)
	hostPort("RECEIPTS_URL", receiptsURL.Host)
	rs := c.Services["receipts"]
	require.Contains(t, strings.Join(rs.Command, " "), "-addr 0.0.0.0:"+receiptsURL.Port())
	rdb, err := url.Parse(rs.Environment["DATABASE_URL"])
	require.NoError(t, err)
	hostPort("receipts DATABASE_URL", rdb.Host)
	require.Contains(t, strings.Join(c.Services["receipts-db"].Command, " "), `CREATE DATABASE `+strings.TrimPrefix(rdb.Path, "/"))
	require.Equal(t, "service_completed_successfully", rs.DependsOn["receipts-db"].Condition)

	// Prometheus scrapes the worker where METRICS_ADDR listens.
	_, metricsPort, err := net.SplitHostPort(worker.Environment["METRICS_ADDR"])
	require.NoError(t, err)
	var prom struct {
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	require.Contains(t, c.Services["prometheus"].Volumes, "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro")
	raw, err = os.ReadFile("../../deploy/prometheus/prometheus.yml")
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal(raw, &prom))
	require.Equal(t, []string{"worker:" + metricsPort}, prom.ScrapeConfigs[0].StaticConfigs[0].Targets)
	// Its rule files are mounted beside its configuration, which names
	// them relative to itself.
	require.NotEmpty(t, prom.RuleFiles)
	for _, f := range prom.RuleFiles {
		require.Contains(t, c.Services["prometheus"].Volumes, "./deploy/prometheus/"+f+":/etc/prometheus/"+f+":ro")
		_, err := os.Stat("../../deploy/prometheus/" + f)
		require.NoError(t, err)
	}

	// Grafana: dashboards and provisioning mounted where the provider and
	// the datasources point.
	g := c.Services["grafana"]
	require.Contains(t, g.Volumes, "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro")
	require.Contains(t, g.Volumes, "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro")
	_, err = os.Stat("../../deploy/grafana/dashboards/dedupactivity.json")
	require.NoError(t, err)
	var provider struct {
		Providers []struct {
			Options struct {
				Path string `yaml:"path"`
			} `yaml:"options"`
		} `yaml:"providers"`
	}
	raw, err = os.ReadFile("../../deploy/grafana/provisioning/dashboards/dashboards.yaml")
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal(raw, &provider))
	require.Equal(t, "/var/lib/grafana/dashboards", provider.Providers[0].Options.Path)
	var ds struct {
		Datasources []struct {
			UID string `yaml:"uid"`
			URL string `yaml:"url"`
		} `yaml:"datasources"`
	}
	raw, err = os.ReadFile("../../deploy/grafana/provisioning/datasources/datasources.yaml")
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal(raw, &ds))
	uids := map[string]bool{}
	for _, d := range ds.Datasources {
		u, err := url.Parse(d.URL)
		require.NoError(t, err)
		hostPort("datasource "+d.UID, u.Host)
		uids[d.UID] = true
	}
	require.True(t, uids["prometheus"] && uids["jaeger"], "the dashboard's datasource uids")

	// Current images; health checks the UI and the worker wait on.
	for name, svc := range c.Services {
		require.NotContains(t, svc.Image, "auto-setup", "%s: temporalio/auto-setup gets no new builds", name)
		require.NotContains(t, svc.Image, "all-in-one", "%s: Jaeger 1.x reached end of life", name)
	}
	require.True(t, strings.HasPrefix(c.Services["jaeger"].Image, "jaegertracing/jaeger:2."))
	for _, name := range []string{"postgres", "temporal", "worker", "prometheus"} {
		require.NotNil(t, c.Services[name].Healthcheck, "%s has a health check", name)
		require.NotEmpty(t, c.Services[name].Healthcheck.Test, name)
	}
	require.Equal(t, "service_healthy", c.Services["temporal-create-namespace"].DependsOn["temporal"].Condition)
	require.Equal(t, "service_completed_successfully", c.Services["temporal-ui"].DependsOn["temporal-create-namespace"].Condition, "the UI waits for the namespace, which waits for a healthy server")
	require.Equal(t, "service_completed_successfully", worker.DependsOn["temporal-create-namespace"].Condition)
	require.Equal(t, "service_healthy", worker.DependsOn["postgres"].Condition)
	require.Equal(t, "service_completed_successfully", c.Services["temporal"].DependsOn["temporal-schema"].Condition)
}
