package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/internal/receipts"
	"github.com/dedupactivity/dedupactivity/workflows"
)

// drained is what the drain step left for the check.
type drained struct {
	runs       []transfer
	results    []workflows.TransferResult
	errs       []error // a transfer's workflow error; nil if it completed
	reconciled outbox.ReconcileReport
}

// drain ends the faults and lets everything settle: the destination is up,
// every workflow finishes with the surviving workers, and the workers'
// relays and a reconciler run until no message is pending, in flight or
// dead. Then the workers stop.
func drain(ctx context.Context, r *rig, cfg config, runs []transfer) (*drained, error) {
	r.proxy.disarm()
	if err := r.receipts.up(ctx); err != nil {
		return nil, err
	}
	d := &drained{runs: runs, results: make([]workflows.TransferResult, len(runs)), errs: make([]error, len(runs))}
	wctx, cancel := context.WithTimeout(ctx, cfg.Drain)
	defer cancel()
	var wg sync.WaitGroup
	for i, t := range runs {
		wg.Go(func() { d.errs[i] = t.run.Get(wctx, &d.results[i]) })
	}
	wg.Wait()

	if err := drainOutbox(ctx, r, cfg.Drain, &d.reconciled); err != nil {
		return nil, err
	}
	time.Sleep(500 * time.Millisecond) // let workers snapshot their counts
	r.stopKeeping()
	r.workers.stopAll()
	return d, nil
}

// drainOutbox runs a reconciler beside the workers' relays until the outbox
// has nothing pending, in flight or dead, or limit passes (the check then
// reports what is left). The reconciler asks the receipts service directly
// about messages unacknowledged for a second and about dead ones: applied
// ones are settled, others re-queued for the relays.
func drainOutbox(ctx context.Context, r *rig, limit time.Duration, total *outbox.ReconcileReport) error {
	rc, err := outbox.NewReconciler(r.outbox, outbox.ReconcilerConfig{
		Checker:      outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{activities.ReceiptsDestination: r.receipts.url + receipts.StatusPath})},
		UnackedAfter: time.Second,
	})
	if err != nil {
		return err
	}
	deadline := time.Now().Add(limit)
	for {
		st, err := r.outbox.Stats(ctx)
		if err == nil && st.Pending+st.Sending+st.Dead == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			r.logf("outbox not drained after %s: %+v (%v)", limit, st, err)
			return nil
		}
		rep, err := rc.Reconcile(ctx)
		if err != nil {
			r.logf("reconcile: %v", err)
		}
		total.Checked += rep.Checked
		total.Applied += rep.Applied
		total.Requeued += rep.Requeued
		if !sleep(ctx, time.Second) {
			return fmt.Errorf("drain outbox: %w", ctx.Err())
		}
	}
}
