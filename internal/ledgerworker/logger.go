package ledgerworker

import (
	"log/slog"
	"os"

	tlog "go.temporal.io/sdk/log"
)

// QuietLogger logs the Temporal SDK's warnings and errors to stderr.
func QuietLogger() tlog.Logger {
	return tlog.NewStructuredLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
}
