package obstest_test

import (
	"context"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/internal/obstest"
)

// TestBackends starts both backends and checks each answers its API: Jaeger
// holds no services yet, and Prometheus scrapes a target this test serves.
func TestBackends(t *testing.T) {
	t.Parallel()
	j, err := obstest.StartJaeger(obstest.Require(t, "jaeger"))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, j.Stop()) })
	services, err := j.Services(context.Background())
	require.NoError(t, err)
	require.Empty(t, services)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("# TYPE probe gauge\nprobe 42\n"))
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })

	p, err := obstest.StartPrometheus(obstest.Require(t, "prometheus"), ln.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Stop()) })
	require.Eventually(t, func() bool {
		s, err := p.Query(context.Background(), `probe{job="ledger-worker"}`)
		return err == nil && len(s) == 1 && s[0].Value == 42
	}, 30*time.Second, 200*time.Millisecond)
	_, err = p.Query(context.Background(), `sum(`)
	require.Error(t, err, "a bad query is an error")
}
