// Command receipts runs the example's receipts service: it stores the
// receipt of every completed transfer, sent by the ledger worker's outbox
// relay, once per Idempotency-Key, in its own PostgreSQL database.
//
//	DATABASE_URL=postgres://.../receipts go run ./cmd/receipts -addr 127.0.0.1:8081 -prune-every 1h
//
// It deletes the keys whose retention is over at start and then every
// -prune-every (Service.Prune).
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dedupactivity/dedupactivity/internal/receipts"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "receipts:", err)
		os.Exit(1)
	}
}

func run() error {
	addr := flag.String("addr", "127.0.0.1:8081", "listen address")
	pruneEvery := flag.Duration("prune-every", time.Hour, "how often to delete the Idempotency-Keys whose retention is over")
	flag.Parse()
	if *pruneEvery <= 0 {
		return fmt.Errorf("-prune-every must be positive, got %v", *pruneEvery)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres:postgres@127.0.0.1:5432/receipts?sslmode=disable"))
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	svc, err := receipts.New(pool)
	if err != nil {
		return err
	}
	if err := svc.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	pruned := make(chan struct{})
	go func() {
		defer close(pruned)
		prune(ctx, svc, *pruneEvery)
	}()
	defer func() { stop(); <-pruned }() // before the pool closes
	srv := &http.Server{Addr: *addr, Handler: svc.Handler(), ReadHeaderTimeout: 5 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.ListenAndServe() }()
	fmt.Printf("receipts service listening on %s\n", *addr)
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// prune deletes expired keys now and then every interval, until ctx is
// done. A failed run is logged and left to the next one.
func prune(ctx context.Context, svc *receipts.Service, every time.Duration) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		if n, err := svc.Prune(ctx); err != nil && ctx.Err() == nil {
			fmt.Fprintln(os.Stderr, "receipts: prune:", err)
		} else if n > 0 {
			fmt.Printf("pruned %d expired keys\n", n)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
