package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.temporal.io/sdk/client"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
)

const (
	accounts = 20
	balance  = 1_000_000
	appName  = "chaos-worker" // application_name of the workers' connections
	// relayLease is the workers' outbox lease: short, so that a send held
	// by the proxy past it is taken over by another relay.
	relayLease = time.Second
	// holdFor bounds how long a send is held: past relayLease, and below
	// the HTTPSender timeout of the ledger worker (5s).
	holdFor = 4500 * time.Millisecond
)

// rig is every part of a run: PostgreSQL (the ledger's database and the
// receipts service's), the Temporal dev server, the receipts service
// process, the proxy in front of it and the worker processes.
type rig struct {
	cluster  *pgtest.Cluster
	client   client.Client
	ledger   *pgxpool.Pool // the ledger's database: accounts, entries, outbox
	outbox   *outbox.Outbox
	receipts *receiptsService
	proxy    *proxy
	workers  *fleet
	// stopKeeping stops restarting exited workers (and waits for it).
	stopKeeping func()
	taskQueue   string
	accounts    []string
	log         io.Writer
	closers     []func()
}

func (r *rig) logf(format string, args ...any) { fmt.Fprintf(r.log, format+"\n", args...) }

func (r *rig) onClose(f func()) { r.closers = append(r.closers, f) }

// close stops every part, last started first.
func (r *rig) close() {
	for i := len(r.closers) - 1; i >= 0; i-- {
		r.closers[i]()
	}
}

// start brings every part up. It starts its own PostgreSQL cluster and
// Temporal dev server (TEMPORAL_ADDRESS is honoured).
func start(ctx context.Context, cfg config) (_ *rig, err error) {
	r := &rig{log: cfg.Log, taskQueue: fmt.Sprintf("chaos-%d", time.Now().UnixNano())}
	if r.log == nil {
		r.log = io.Discard
	}
	defer func() {
		if err != nil {
			r.close()
		}
	}()
	if r.cluster, err = pgtest.StartCluster(); err != nil {
		return nil, fmt.Errorf("start PostgreSQL: %w", err)
	}
	r.onClose(func() { _ = r.cluster.Destroy() })
	srv, err := temporaltest.Start(ctx, temporaltest.Options{})
	if err != nil {
		return nil, err
	}
	r.onClose(func() { _ = srv.Stop() })
	if r.client, err = srv.Dial(); err != nil {
		return nil, err
	}
	r.onClose(r.client.Close)

	dir, err := os.MkdirTemp("", "chaos-")
	if err != nil {
		return nil, err
	}
	r.onClose(func() { _ = os.RemoveAll(dir) })
	r.logf("building the worker and the receipts service ...")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", dir+"/",
		"github.com/dedupactivity/dedupactivity/worker", "github.com/dedupactivity/dedupactivity/cmd/receipts").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build: %w: %s", err, out)
	}

	if err := r.openLedger(ctx); err != nil {
		return nil, err
	}
	receiptsURL, err := createDatabase(ctx, r.cluster.URL(), "receipts")
	if err != nil {
		return nil, err
	}
	if r.receipts, err = startReceipts(ctx, filepath.Join(dir, "receipts"), receiptsURL); err != nil {
		return nil, err
	}
	r.onClose(r.receipts.stop)
	if r.proxy, err = startProxy(r.receipts.url, cfg.Workers); err != nil {
		return nil, err
	}
	r.onClose(r.proxy.close)

	r.workers = &fleet{bin: filepath.Join(dir, "worker"), dir: dir, env: func(slot int) []string {
		return []string{
			"TEMPORAL_ADDRESS=" + srv.Address,
			"TASK_QUEUE=" + r.taskQueue,
			"DATABASE_URL=" + r.cluster.URL() + "&application_name=" + appName,
			"RECEIPTS_URL=" + r.proxy.url(slot), // each worker's relay through its own proxy port
			"OUTBOX_RELAY_LEASE=" + relayLease.String(),
		}
	}}
	if err := r.workers.startAll(cfg.Workers); err != nil {
		return nil, err
	}
	r.onClose(r.workers.stopAll)
	keepCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	kept := make(chan struct{})
	go func() { defer close(kept); r.workers.keep(keepCtx, cfg.Workers) }()
	r.stopKeeping = func() { cancel(); <-kept }
	r.onClose(r.stopKeeping)
	return r, nil
}

// openLedger migrates the ledger's database (markers, ledger, outbox) and
// opens the accounts.
func (r *rig) openLedger(ctx context.Context) error {
	pool, err := pgxpool.New(ctx, r.cluster.URL())
	if err != nil {
		return err
	}
	r.ledger = pool
	r.onClose(pool.Close)
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	if err != nil {
		return err
	}
	if err := d.Migrate(ctx); err != nil {
		return err
	}
	if err := activities.Migrate(ctx, pool); err != nil {
		return err
	}
	if r.outbox, err = outbox.New(pool, outbox.Options{}); err != nil {
		return err
	}
	if err := r.outbox.Migrate(ctx); err != nil {
		return err
	}
	r.accounts = make([]string, accounts)
	for i := range r.accounts {
		r.accounts[i] = fmt.Sprintf("acct-%02d", i)
	}
	return activities.OpenAccounts(ctx, pool, balance, r.accounts...)
}

// createDatabase creates database name on the server of serverURL and
// returns its URL.
func createDatabase(ctx context.Context, serverURL, name string) (string, error) {
	conn, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	cfg, err := pgx.ParseConfig(serverURL)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", cfg.User, cfg.Host, cfg.Port, name), nil
}
