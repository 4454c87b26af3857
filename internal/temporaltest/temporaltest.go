// Package temporaltest gives tests and the demo a real Temporal server.
//
// The server is TEMPORAL_ADDRESS when set; otherwise a dev server started with
// testsuite.StartDevServer from a temporal CLI binary found on PATH or in the
// repository's bin/ (make temporal-cli builds it there from the Go module
// proxy). Nothing is downloaded. One server is started per process; call
// Stop when done (from TestMain).
package temporaltest

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"go.temporal.io/sdk/client"
	tlog "go.temporal.io/sdk/log"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/internal/toolbin"
)

// Namespace is the namespace tests use.
const Namespace = "default"

// Server is a reachable Temporal server.
type Server struct {
	// Address is the frontend host:port.
	Address string
	// UIAddress is the Web UI's URL, when this process started the server
	// with the UI enabled.
	UIAddress string
	dev       *testsuite.DevServer
}

// Dial returns a new client for the server.
func (s *Server) Dial() (client.Client, error) {
	return client.Dial(client.Options{HostPort: s.Address, Namespace: Namespace, Logger: quietLogger()})
}

// Stop stops the server if this process started it.
func (s *Server) Stop() error {
	if s == nil || s.dev == nil {
		return nil
	}
	return s.dev.Stop()
}

// Options for Start.
type Options struct {
	// EnableUI starts the dev server's Web UI on UIPort.
	EnableUI bool
	UIPort   string
	// Stderr receives the dev server's output; nil discards it.
	Stderr io.Writer
	// HostPort is the frontend's address, for a server that must be on a
	// given port (TEMPORAL_ADDRESS is then not used); empty picks a free
	// port.
	HostPort string
}

// Start starts a dev server (or returns TEMPORAL_ADDRESS).
func Start(ctx context.Context, opts Options) (*Server, error) {
	if addr := os.Getenv("TEMPORAL_ADDRESS"); addr != "" && opts.HostPort == "" {
		return &Server{Address: addr}, nil
	}
	path, err := CLIPath()
	if err != nil {
		return nil, err
	}
	out := opts.Stderr
	if out == nil {
		out = io.Discard
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	dev, err := testsuite.StartDevServer(ctx, testsuite.DevServerOptions{
		ExistingPath:  path,
		ClientOptions: &client.Options{HostPort: opts.HostPort, Namespace: Namespace, Logger: quietLogger()},
		EnableUI:      opts.EnableUI,
		UIPort:        opts.UIPort,
		LogLevel:      "error",
		Stdout:        out,
		Stderr:        out,
	})
	if err != nil {
		return nil, fmt.Errorf("start dev server (%s): %w", path, err)
	}
	dev.Client().Close()
	s := &Server{Address: dev.FrontendHostPort(), dev: dev}
	if opts.EnableUI && opts.UIPort != "" {
		s.UIAddress = "http://127.0.0.1:" + opts.UIPort
	}
	return s, nil
}

// CLIPath finds the temporal CLI: TEMPORAL_CLI if set, then PATH, then bin/
// at the repository root.
func CLIPath() (string, error) {
	if p := os.Getenv("TEMPORAL_CLI"); p != "" {
		return p, nil
	}
	if p, err := exec.LookPath("temporal"); err == nil {
		return p, nil
	}
	p, err := toolbin.Path("temporal")
	if err != nil {
		return "", fmt.Errorf("temporal CLI not on PATH nor in bin/: run make temporal-cli (%w)", err)
	}
	return p, nil
}

var (
	once     sync.Once
	shared   *Server
	startErr error
)

// Shared returns the process-wide server, starting it on first use.
func Shared() (*Server, error) {
	once.Do(func() { shared, startErr = Start(context.Background(), Options{}) })
	return shared, startErr
}

// StopShared stops the process-wide server, if one was started.
func StopShared() {
	if shared != nil {
		if err := shared.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "temporaltest: stop: %v\n", err)
		}
	}
}

// Require returns the shared server or ends the test: it fails under
// CI=true and is skipped elsewhere.
func Require(tb testing.TB) *Server {
	tb.Helper()
	s, err := Shared()
	if err != nil {
		if os.Getenv("CI") == "true" {
			tb.Fatalf("temporaltest: no Temporal server (required under CI=true): %v", err)
		}
		tb.Skipf("temporaltest: no Temporal server, skipping (set TEMPORAL_ADDRESS or run make temporal-cli): %v", err)
	}
	return s
}

// quietLogger logs warnings and errors only.
func quietLogger() tlog.Logger {
	return tlog.NewStructuredLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
}
