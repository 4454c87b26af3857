package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
	"github.com/dedupactivity/dedupactivity/workflows"
)

func TestMain(m *testing.M) {
	code := m.Run()
	temporaltest.StopShared()
	pgtest.StopShared()
	os.Exit(code)
}

// TestWorkerKilledMidEffect SIGKILLs the worker process while a credit's
// transaction is open, then starts a new worker process: the workflow
// finishes and the credit is applied once.
func TestWorkerKilledMidEffect(t *testing.T) {
	t.Parallel()
	srv := temporaltest.Require(t)
	s := pgtest.NewSchema(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	require.NoError(t, activities.Migrate(ctx, s.Pool))
	require.NoError(t, activities.OpenAccounts(ctx, s.Pool, 100, "alice", "bob"))

	bin := filepath.Join(t.TempDir(), "worker")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)

	b := make([]byte, 6)
	_, _ = rand.Read(b)
	taskQueue := "kill-" + hex.EncodeToString(b)
	startWorker := func() *exec.Cmd {
		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(), "TEMPORAL_ADDRESS="+srv.Address, "TASK_QUEUE="+taskQueue, "DATABASE_URL="+s.URL)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	first := startWorker()

	c, err := srv.Dial()
	require.NoError(t, err)
	defer c.Close()
	run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: "killed", TaskQueue: taskQueue}, workflows.TransferWorkflowName,
		workflows.TransferRequest{TransferID: "killed", From: "alice", To: "bob", Amount: 30,
			StartToClose: 3 * time.Second, Faults: activities.Faults{StallCredit: time.Minute}})
	require.NoError(t, err)

	// Wait until the credit's claim transaction has written and is open.
	openTx := func() int {
		var n int
		require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE state = 'idle in transaction' AND query LIKE '%UPDATE account%' AND datname = current_database()`).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return openTx() == 1 }, time.Minute, 50*time.Millisecond, "credit never got mid-effect")

	require.NoError(t, first.Process.Signal(syscall.SIGKILL))
	_, _ = first.Process.Wait()
	require.Eventually(t, func() bool { return openTx() == 0 }, 30*time.Second, 50*time.Millisecond, "the killed worker's transaction stayed open")
	var credits int
	require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entry WHERE transfer_id = 'killed' AND kind = 'credit'`).Scan(&credits))
	require.Zero(t, credits, "the killed attempt's effect rolled back")

	startWorker()
	var res workflows.TransferResult
	require.NoError(t, run.Get(ctx, &res))
	require.Greater(t, res.Credit.Attempt, int32(1))
	require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entry WHERE transfer_id = 'killed' AND kind = 'credit'`).Scan(&credits))
	require.Equal(t, 1, credits, "the credit applied once")
	var total int64
	require.NoError(t, s.Pool.QueryRow(ctx, `SELECT sum(balance) FROM account`).Scan(&total))
	require.Equal(t, int64(200), total, "money is conserved")
}

// TestWorkerWaitsForTemporal: the example worker started before its
// Temporal server (a compose stack coming up) keeps dialling, as
// docs/design.md says, until its context ends, instead of exiting at once
// with "connection refused".
func TestWorkerWaitsForTemporal(t *testing.T) {
	s := pgtest.NewSchema(t)
	port, err := pgtest.FreePort()
	require.NoError(t, err)
	t.Setenv("TEMPORAL_ADDRESS", "127.0.0.1:"+strconv.Itoa(port)) // nothing answers there
	t.Setenv("DATABASE_URL", s.URL)
	for _, name := range []string{"RECEIPTS_URL", "METRICS_ADDR", "DEDUP_COUNTS_FILE", "OTEL_EXPORTER_OTLP_ENDPOINT",
		"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "PRUNE_INTERVAL", "OUTBOX_RELAY_LEASE"} {
		t.Setenv(name, "")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
	defer cancel()
	err = run(ctx)
	require.ErrorContains(t, err, "connect to Temporal")
	require.ErrorIs(t, err, context.DeadlineExceeded, "still dialling when its context ended")
}
