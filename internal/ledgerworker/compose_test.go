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
	require.Equal(t, ledgerworker.DefaultNamespace, c.Services["temporal"].Environment["DEFAULT_NAMESPACE"])

	require.Equal(t, "jaeger", published["4317"], "OTLP gRPC for OTEL_EXPORTER_OTLP_ENDPOINT")
	require.Equal(t, "jaeger", published["16686"], "Jaeger UI")
	require.Equal(t, "temporal-ui", published["8080"])
}
