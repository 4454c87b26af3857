package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"go.temporal.io/sdk/client"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/workflows"
)

// transfer is a started transfer workflow.
type transfer struct {
	req workflows.TransferRequest
	run client.WorkflowRun
}

// faults counts the faults the harness injected itself (the proxy counts
// its own).
type faults struct {
	Kills, Terminations, Restarts, Outages atomic.Int64
}

// inject starts transfers at cfg.Rate for cfg.Duration while every fault
// of cfg runs in its own goroutine, and returns the started transfers.
func inject(ctx context.Context, r *rig, cfg config) ([]transfer, *faults) {
	phase, stop := context.WithTimeout(ctx, cfg.Duration)
	defer stop()
	f := &faults{}
	r.proxy.arm(cfg.DropEvery, cfg.HoldEvery, r.workers.kill)
	defer r.proxy.disarm()

	var runs []transfer
	var runsMu sync.Mutex
	var wg sync.WaitGroup
	wg.Go(func() {
		for t := range startTransfers(phase, r, cfg.Rate) {
			runsMu.Lock()
			runs = append(runs, t)
			runsMu.Unlock()
		}
	})
	every(phase, &wg, cfg.KillEvery, func() {
		if err := r.workers.killAny(); err != nil {
			r.logf("kill worker: %v", err)
			return
		}
		f.Kills.Add(1)
	})
	every(phase, &wg, cfg.TerminateEvery, func() {
		var n int64
		if err := r.ledger.QueryRow(ctx, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE application_name = $1 ORDER BY random() LIMIT 1) t`, appName).Scan(&n); err == nil {
			f.Terminations.Add(n)
		}
	})
	every(phase, &wg, cfg.RelayKillEvery, r.proxy.armKill)
	every(phase, &wg, cfg.OutageEvery, func() {
		r.logf("  receipts service down for %s ...", cfg.OutageFor)
		r.receipts.kill()
		f.Outages.Add(1)
		sleep(ctx, cfg.OutageFor) // the whole outage, even past the phase
		if err := r.receipts.up(ctx); err != nil {
			r.logf("restart receipts service: %v", err)
		}
	})
	if cfg.RestartPostgres {
		wg.Go(func() {
			if !sleep(phase, cfg.Duration/2) {
				return
			}
			r.logf("  restarting PostgreSQL (fast shutdown) ...")
			if err := r.cluster.Stop(); err != nil {
				r.logf("stop PostgreSQL: %v", err)
				return
			}
			time.Sleep(500 * time.Millisecond)
			if err := r.cluster.Start(); err != nil {
				r.logf("start PostgreSQL: %v", err)
				return
			}
			f.Restarts.Add(1)
		})
	}
	every(phase, &wg, 10*time.Second, func() {
		runsMu.Lock()
		n := len(runs)
		runsMu.Unlock()
		pc := r.proxy.counts()
		r.logf("  %d workflows started; %d workers killed, %d backends terminated; receipts: %d POSTs, %d dropped, %d relays killed, %d held, %d outages",
			n, f.Kills.Load(), f.Terminations.Load(), pc.Posts, pc.Dropped, pc.RelaysKilled, pc.Held, f.Outages.Load())
	})
	wg.Wait()
	return runs, f
}

// every runs fn about every mean (jittered) until ctx is done; a zero mean
// never runs it.
func every(ctx context.Context, wg *sync.WaitGroup, mean time.Duration, fn func()) {
	if mean <= 0 {
		return
	}
	wg.Go(func() {
		for sleep(ctx, jitter(mean)) {
			fn()
		}
	})
}

// startTransfers starts transfer workflows at rate until ctx is done. Every
// 4th loses its debit's first completion, every 7th has an overlapping
// credit attempt.
func startTransfers(ctx context.Context, r *rig, rate float64) <-chan transfer {
	out := make(chan transfer)
	go func() {
		defer close(out)
		tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			from := rand.IntN(accounts)
			req := workflows.TransferRequest{
				TransferID: fmt.Sprintf("%s-%05d", r.taskQueue, i),
				From:       r.accounts[from], To: r.accounts[(from+1+rand.IntN(accounts-1))%accounts],
				Amount: 1 + rand.Int64N(50), StartToClose: 3 * time.Second,
				Faults: activities.Faults{LoseCompletion: i%4 == 0},
			}
			if i%7 == 3 {
				req.Faults.StallCredit = 3500 * time.Millisecond
			}
			run, err := r.client.ExecuteWorkflow(context.WithoutCancel(ctx), client.StartWorkflowOptions{ID: req.TransferID, TaskQueue: r.taskQueue},
				workflows.TransferWorkflowName, req)
			if err != nil {
				r.logf("start %s: %v", req.TransferID, err)
				continue
			}
			out <- transfer{req: req, run: run}
		}
	}()
	return out
}
