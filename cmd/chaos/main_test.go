package chaos

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
)

// TestChaosShort is the short chaos run of make test: separate worker
// processes, SIGKILLs, terminated backends, forced redeliveries and a
// PostgreSQL restart; nothing may be applied twice or lost.
func TestChaosShort(t *testing.T) {
	if _, err := temporaltest.CLIPath(); err != nil && os.Getenv("TEMPORAL_ADDRESS") == "" {
		temporaltest.Require(t) // fails under CI, skips elsewhere, with the reason
	}
	rep, err := Run(context.Background(), Config{
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
	require.Positive(t, rep.Kills, "faults were injected")
	require.Positive(t, rep.Terminations)
	require.Equal(t, 1, rep.Restarts)
	require.Positive(t, rep.Attempts["duplicate"], "redeliveries happened")
	require.Equal(t, rep.Expected, rep.Effects)
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }
