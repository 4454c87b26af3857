package pgtest

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestClusterStopsWhenItsProcessDies: a process that started a cluster and
// exits without Destroy (a test binary that panicked, timed out or was
// killed) leaves no server running and no directory: the reaper stops and
// removes them. The process here is this test binary run again.
func TestClusterStopsWhenItsProcessDies(t *testing.T) {
	if os.Getenv("PGTEST_REAPER_CHILD") == "1" {
		c, err := StartCluster()
		if err != nil {
			os.Stdout.WriteString("error: " + err.Error() + "\n")
			os.Exit(2)
		}
		os.Stdout.WriteString("dir: " + c.Dir + "\n")
		os.Exit(3) // no Destroy
	}
	if _, err := BinDir(); err != nil {
		unavailable(t, "no local PostgreSQL binaries", err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestClusterStopsWhenItsProcessDies$")
	cmd.Env = append(os.Environ(), "PGTEST_REAPER_CHILD=1")
	out, err := cmd.Output()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 3 {
		t.Fatalf("the child: %v\n%s", err, out)
	}
	_, dir, ok := strings.Cut(string(bytes.TrimSpace(out)), "dir: ")
	if !ok || !strings.HasPrefix(filepath.Base(dir), "pgtest-") {
		t.Fatalf("the child printed no cluster directory:\n%s", out)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := os.Stat(dir)
		running := serverRunningIn(t, dir)
		if errors.Is(err, os.ErrNotExist) && !running {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("30s after its process exited, the cluster in %s is still there (directory: %v, a server running: %v)", dir, err == nil, running)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// serverRunningIn says whether a postgres process runs on the data
// directory in dir, from /proc.
func serverRunningIn(t *testing.T, dir string) bool {
	t.Helper()
	cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range cmdlines {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue // the process exited
		}
		args := strings.Split(string(raw), "\x00")
		if strings.HasSuffix(args[0], "postgres") && strings.Contains(string(raw), filepath.Join(dir, "data")) {
			return true
		}
	}
	return false
}
