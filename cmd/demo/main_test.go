package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
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
	require.Contains(t, string(out), "Temporal Web UI: http://127.0.0.1:")
}
