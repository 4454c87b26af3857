// Command chaos runs the ledger example and its receipts outbox under
// faults, on a real Temporal dev server and a real PostgreSQL, with every
// part in its own process: worker processes (each also running an outbox
// relay loop) and the receipts service with its own database, reached
// through a fault-injecting proxy on 127.0.0.1.
//
// Faults in the ledger: SIGKILLed workers, terminated database backends,
// forced redeliveries and a PostgreSQL restart. Faults at the outbox
// boundary: responses dropped after the destination committed, relays
// SIGKILLed between send and acknowledgement, sends held past the relay's
// lease (so two relays send one message), and the destination down for a
// while.
//
// A run has four steps (start, inject, drain, check); the check counts with
// SQL on both databases. It prints what happened and exits non-zero if any
// transfer or receipt was applied twice or lost, money was not conserved, or
// a dead letter is left once the destination is back.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"time"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(1)
	}
}

func run() error {
	cfg := config{Log: os.Stdout}
	flag.DurationVar(&cfg.Duration, "duration", 100*time.Second, "length of the fault phase")
	flag.IntVar(&cfg.Workers, "workers", 3, "worker processes (each runs a relay loop)")
	flag.Float64Var(&cfg.Rate, "rate", 8, "workflows started per second")
	flag.DurationVar(&cfg.KillEvery, "kill-every", 6*time.Second, "mean interval between worker SIGKILLs (0: never)")
	flag.DurationVar(&cfg.TerminateEvery, "terminate-every", 1500*time.Millisecond, "mean interval between pg_terminate_backend calls (0: never)")
	flag.BoolVar(&cfg.RestartPostgres, "restart-postgres", true, "restart PostgreSQL once, half way")
	flag.IntVar(&cfg.DropEvery, "drop-every", 5, "drop the response of every Nth receipt delivery after the destination committed (0: never)")
	flag.IntVar(&cfg.HoldEvery, "hold-every", 9, "hold every Nth first send of a receipt past the relay lease, so a second relay sends it (0: never)")
	flag.DurationVar(&cfg.RelayKillEvery, "relay-kill-every", 8*time.Second, "mean interval between relays SIGKILLed after the destination committed, before they acknowledge (0: never)")
	flag.DurationVar(&cfg.OutageEvery, "outage-every", 30*time.Second, "mean interval between receipts-service outages (0: never)")
	flag.DurationVar(&cfg.OutageFor, "outage-for", 8*time.Second, "how long the receipts service stays down")
	flag.DurationVar(&cfg.Drain, "drain", 5*time.Minute, "how long to wait for workflows, then for the outbox, after the fault phase")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	rep, err := chaos(ctx, cfg)
	if err != nil {
		return err
	}
	rep.print(os.Stdout)
	if !rep.OK() {
		return fmt.Errorf("%d violations", len(rep.Violations))
	}
	return nil
}

// config sets a run's size and faults. A zero interval or count turns its
// fault off.
type config struct {
	Duration       time.Duration // fault phase; workflows are started throughout it
	Workers        int           // worker processes kept running
	Rate           float64       // workflows started per second
	KillEvery      time.Duration // mean interval between worker SIGKILLs
	TerminateEvery time.Duration // mean interval between pg_terminate_backend calls
	// RestartPostgres restarts PostgreSQL (fast shutdown + start) once, half
	// way through.
	RestartPostgres bool
	DropEvery       int           // every Nth receipt POST: response dropped after commit
	HoldEvery       int           // every Nth first send of a key: held past the relay lease
	RelayKillEvery  time.Duration // mean interval between relays killed between send and ack
	OutageEvery     time.Duration // mean interval between receipts-service outages
	OutageFor       time.Duration // length of each outage
	Drain           time.Duration // bounds each wait after the fault phase
	Log             io.Writer     // progress lines; nil discards them
}

// chaos is one run: start every part, inject faults while starting
// transfers, drain (faults off, destination back, everything settled), and
// check both databases.
func chaos(ctx context.Context, cfg config) (*report, error) {
	began := time.Now()
	r, err := start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer r.close()

	runs, faults := inject(ctx, r, cfg)
	r.logf("fault phase over: draining %d workflows and the outbox ...", len(runs))
	done, err := drain(ctx, r, cfg, runs)
	if err != nil {
		return nil, err
	}
	rep, err := check(ctx, r, done)
	if err != nil {
		return nil, err
	}
	rep.Faults = faults
	rep.Proxy = r.proxy.counts()
	rep.Reconciled = done.reconciled
	if rep.Attempts, err = r.workers.counts(); err != nil {
		return nil, err
	}
	rep.Took = time.Since(began)
	return rep, nil
}
