package ledgerworker_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
)

// TestMigrationRetriesWhileTheServerRestarts: a worker starting while
// PostgreSQL is down (a restart, a fail-over) keeps trying its migration
// with backoff and succeeds once the server is back; an error a retry cannot
// fix is returned at once.
func TestMigrationRetriesWhileTheServerRestarts(t *testing.T) {
	t.Parallel()
	c := pgtest.NewCluster(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, c.URL())
	require.NoError(t, err)
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)

	require.NoError(t, c.Stop())
	require.Error(t, d.Migrate(ctx), "without a retry the start fails")
	done := make(chan error, 1)
	go func() { done <- ledgerworker.Retry(ctx, time.Minute, d.Migrate) }()
	time.Sleep(time.Second)
	require.NoError(t, c.Start())
	require.NoError(t, <-done)
	var ok bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass('dedup_marker') IS NOT NULL`).Scan(&ok))
	require.True(t, ok)

	_, err = pool.Exec(ctx, `INSERT INTO dedup_marker_migration (version, name) VALUES (999, 'newer')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `ALTER TABLE dedup_marker DROP COLUMN result`)
	require.NoError(t, err)
	began := time.Now()
	err = ledgerworker.Retry(ctx, time.Minute, d.Migrate)
	require.ErrorIs(t, err, dedupactivity.ErrSchemaTooNew)
	require.Less(t, time.Since(began), 5*time.Second, "not retried")
}

// TestDialRetriesUntilTemporalAnswers: a worker started before its
// Temporal server (a compose stack coming up, a server restarting) keeps
// dialling with backoff and connects once the server answers.
func TestDialRetriesUntilTemporalAnswers(t *testing.T) {
	t.Parallel()
	port, err := pgtest.FreePort()
	require.NoError(t, err)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	opts := client.Options{HostPort: addr, Namespace: temporaltest.Namespace}
	ctx := context.Background()
	_, err = client.Dial(opts)
	require.Error(t, err, "without a retry the start fails")

	done := make(chan error, 1)
	go func() {
		c, err := ledgerworker.DialTemporal(ctx, 2*time.Minute, opts)
		if err == nil {
			c.Close()
		}
		done <- err
	}()
	time.Sleep(time.Second)
	srv, err := temporaltest.Start(ctx, temporaltest.Options{HostPort: addr})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Stop() })
	require.NoError(t, <-done)

	// Nothing ever answers: it gives up after giveUp, with the dial's error,
	// and says so at every try meanwhile.
	other, err := pgtest.FreePort()
	require.NoError(t, err)
	warned := &warnings{}
	began := time.Now()
	_, err = ledgerworker.DialTemporal(ctx, 2*time.Second, client.Options{HostPort: "127.0.0.1:" + strconv.Itoa(other), Logger: warned})
	require.ErrorContains(t, err, "connection refused")
	require.Less(t, time.Since(began), 10*time.Second)
	require.Greater(t, time.Since(began), time.Second, "retried before giving up")
	require.Greater(t, warned.n.Load(), int32(1), "each failed try is logged")
}

// warnings is a Temporal logger that counts warnings.
type warnings struct{ n atomic.Int32 }

func (w *warnings) Debug(string, ...any) {}
func (w *warnings) Info(string, ...any)  {}
func (w *warnings) Warn(string, ...any)  { w.n.Add(1) }
func (w *warnings) Error(string, ...any) {}
