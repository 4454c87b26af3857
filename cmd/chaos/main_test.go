package main

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
)

// TestChaosShort is the short chaos run of make test, in the ledger:
// separate worker processes, SIGKILLs, terminated backends, forced
// redeliveries and a PostgreSQL restart; nothing may be applied twice or
// lost, and each completed transfer has one receipt at the destination.
func TestChaosShort(t *testing.T) {
	requireTemporal(t)
	rep, err := chaos(context.Background(), config{
		Duration:        25 * time.Second,
		Workers:         3,
		Rate:            6,
		KillEvery:       5 * time.Second,
		TerminateEvery:  1500 * time.Millisecond,
		RestartPostgres: true,
		Drain:           3 * time.Minute,
		Log:             testWriter{t},
	})
	require.NoError(t, err)
	t.Logf("%+v", *rep)
	require.True(t, rep.OK(), "violations: %v", rep.Violations)
	require.Greater(t, rep.Started, 50)
	require.Equal(t, rep.Started, rep.Completed)
	require.Positive(t, rep.Faults.Kills.Load(), "faults were injected")
	require.Positive(t, rep.Faults.Terminations.Load())
	require.EqualValues(t, 1, rep.Faults.Restarts.Load())
	require.Positive(t, rep.LostCompletionsFired, "redeliveries happened: debits committed at attempt 1 and completed by a later one")
	require.Equal(t, rep.Expected, rep.Effects)
	require.EqualValues(t, rep.Completed, rep.ReceiptsApplied)
}

// TestChaosOutboxBoundaryShort is the short chaos run of the outbox
// boundary: responses dropped after the destination committed, relays
// SIGKILLed between send and acknowledgement, sends held past the lease so
// two relays send one message, and the receipts service down for a while.
// After the drain each completed transfer's receipt is applied exactly once
// at the destination, none is lost and no dead letter is left.
func TestChaosOutboxBoundaryShort(t *testing.T) {
	requireTemporal(t)
	rep, err := chaos(context.Background(), config{
		Duration:       20 * time.Second,
		Workers:        2,
		Rate:           6,
		DropEvery:      4,
		HoldEvery:      6,
		RelayKillEvery: 4 * time.Second,
		OutageEvery:    9 * time.Second,
		OutageFor:      3 * time.Second,
		Drain:          time.Minute,
		Log:            testWriter{t},
	})
	require.NoError(t, err)
	t.Logf("%+v", *rep)
	require.True(t, rep.OK(), "violations: %v", rep.Violations)
	require.Greater(t, rep.Started, 50)
	require.Equal(t, rep.Started, rep.Completed)
	// Every fault happened, and made re-sends.
	require.Positive(t, rep.Proxy.Dropped, "responses dropped")
	require.Positive(t, rep.Proxy.RelaysKilled, "relays killed between send and ack")
	require.Positive(t, rep.Proxy.Held, "sends held past the lease")
	require.Positive(t, rep.Proxy.Overlapping, "two relays sent one message at once")
	require.Positive(t, rep.Faults.Outages.Load(), "destination down")
	require.Positive(t, rep.Proxy.Unavailable, "sends failed while the destination was down")
	require.Positive(t, rep.Proxy.Replayed, "re-sends reached the destination and were replayed")
	// The invariant, counted with SQL on both databases.
	require.EqualValues(t, rep.Completed, rep.Enqueued)
	require.EqualValues(t, rep.Completed, rep.ReceiptsApplied)
	require.Zero(t, rep.ReceiptsDouble)
	require.Zero(t, rep.ReceiptsLost)
	require.Zero(t, rep.Dead)
	require.Zero(t, rep.Rejected)
	require.Zero(t, rep.Unsettled)
}

func requireTemporal(t *testing.T) {
	if _, err := temporaltest.CLIPath(); err != nil && os.Getenv("TEMPORAL_ADDRESS") == "" {
		temporaltest.Require(t) // fails under CI, skips elsewhere, with the reason
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }
