package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/internal/obstest"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

// TestDemo runs the demo binary as make demo does (its own PostgreSQL and
// Temporal dev server) with fewer workflows, and checks it ends with the
// invariant holding.
func TestDemo(t *testing.T) {
	t.Parallel()
	bin := filepath.Join(t.TempDir(), "demo")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	cmd := exec.Command(bin, "-workflows", "15")
	cmd.Env = append(os.Environ(), "DATABASE_URL=", "TEMPORAL_ADDRESS=")
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "INVARIANT HOLDS")
	require.Contains(t, string(out), "workflows completed       15")
	// The faults fired: the report fails otherwise, and says so here.
	require.Regexp(t, `injected: lost receipt acknowledgements\s+1\s`, string(out))
	require.Regexp(t, `exactly one receipt at the destination \(15, [1-9]\d* of them sent again\)`, string(out))
	require.Contains(t, string(out), "Temporal Web UI: http://127.0.0.1:")
}

// TestDemoOnYourDatabase runs the demo on a server it did not start
// (DATABASE_URL), as a user trying it on their own PostgreSQL would, and
// checks by SQL that it left no receipts database behind.
func TestDemoOnYourDatabase(t *testing.T) {
	t.Parallel()
	c := pgtest.NewCluster(t)
	bin := filepath.Join(t.TempDir(), "demo")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	// Every debit loses its completion: the report wants one of them to
	// fire, and one alone could roll back on a stalled credit's row lock.
	cmd := exec.Command(bin, "-workflows", "3", "-lost-every", "1")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+c.URL(), "TEMPORAL_ADDRESS=")
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "INVARIANT HOLDS")

	ctx := context.Background()
	conn, err := pgx.Connect(ctx, c.URL())
	require.NoError(t, err)
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT datname FROM pg_database WHERE datname LIKE 'receipts\_%'`)
	require.NoError(t, err)
	left, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Empty(t, left, "the demo's receipts database is dropped at its end")
	var ledgerRows int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM ledger_entry`).Scan(&ledgerRows))
	require.Equal(t, 6, ledgerRows, "a debit and a credit for each of 3 transfers, in your database")
}

// TestDemoTraces runs the demo as make demo-traces does (without -hold):
// Jaeger v2 beside the dev server, the worker's spans exported over OTLP,
// and the demo reading back, from Jaeger's HTTP API, a debit's trace with a
// claimed and a duplicate Dedup child and a summary of what Jaeger holds.
func TestDemoTraces(t *testing.T) {
	t.Parallel()
	jaeger := obstest.Require(t, "jaeger")
	bin := filepath.Join(t.TempDir(), "demo")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	cmd := exec.Command(bin, "-workflows", "6", "-traces")
	cmd.Env = append(os.Environ(), "DATABASE_URL=", "TEMPORAL_ADDRESS=", "JAEGER_BIN="+jaeger)
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "INVARIANT HOLDS")
	require.Regexp(t, `Jaeger holds \d+ traces of ledger-demo with \d+ spans; Dedup spans by outcome: claimed \d+, duplicate \d+`, string(out))
	require.Regexp(t, `applied once .*: http://127\.0\.0\.1:\d+/api/traces/[0-9a-f]{32}\n`, string(out))
}
