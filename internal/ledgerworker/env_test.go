package ledgerworker_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

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
