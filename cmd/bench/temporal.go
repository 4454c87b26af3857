package main

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
)

type temporalResult struct {
	bare, wrapped float64   // activities per second over all rounds
	ratios        []float64 // wrapped/bare per ABBA round, sorted
	activities    int
	rounds        int
	// CPU time over all rounds, by activity type: PostgreSQL's, this
	// process's (the worker and the client starting the workflows), and
	// the rest of the machine's (the dev server's, mostly).
	cpu map[string]*temporalCPU
}

// temporalCPU is what the measurements of one activity type used.
type temporalCPU struct {
	server, client, rest time.Duration
	cpuKnown             bool // the CPU times of every measurement were read
	activities           int
	events               int64 // in the workflows' histories
}

// cpuReading is the CPU time used so far: by PostgreSQL (-1 if unknown),
// by this process, and by the whole machine (-1 if unknown).
type cpuReading struct{ server, client, busy time.Duration }

func readCPU(m cpuMeter) cpuReading {
	server, client := m.read()
	return cpuReading{server, client, machineBusy()}
}

// add counts a measurement of n activities whose histories hold events,
// with the CPU read before and after it. The rest is the machine's CPU
// time that neither PostgreSQL nor this process used: the dev server's,
// and the kernel's interrupt time (the loopback network's, say).
func (c *temporalCPU) add(n int, events int64, before, after cpuReading) {
	known := before.server >= 0 && after.server >= 0 && before.busy >= 0 && after.busy >= 0
	c.cpuKnown = known && (c.cpuKnown || c.activities == 0)
	c.activities += n
	c.events += events
	if known {
		server, client := after.server-before.server, after.client-before.client
		c.server += server
		c.client += client
		c.rest += after.busy - before.busy - server - client
	}
}

// perActivity returns the CPU time per activity, in µs.
func (c *temporalCPU) perActivity() (server, client, rest float64) {
	n := float64(max(c.activities, 1))
	return c.server.Seconds() * 1e6 / n, c.client.Seconds() * 1e6 / n, c.rest.Seconds() * 1e6 / n
}

// fanOut runs n activities of the given type at once and waits for all.
func fanOut(ctx workflow.Context, activityType, prefix string, n int) error {
	ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{StartToCloseTimeout: time.Minute})
	futures := make([]workflow.Future, n)
	for i := range n {
		key := fmt.Sprintf("%s-%d", prefix, i)
		futures[i] = workflow.ExecuteActivity(ctx, activityType, posting{Key: key, Account: i % accounts, Amount: 1})
	}
	for _, f := range futures {
		if err := f.Get(ctx, nil); err != nil {
			return err
		}
	}
	return nil
}

// temporalThroughput compares, on a real dev server, a wrapped activity with
// the same effect unwrapped: ABBA-interleaved rounds of total activities.
func temporalThroughput(ctx context.Context, url string, meter cpuMeter, total, rounds int, effect dedupactivity.EffectFunc[posting, receipt]) (temporalResult, error) {
	res := temporalResult{activities: total, rounds: rounds, cpu: map[string]*temporalCPU{"Bare": {}, "Wrapped": {}}}
	srv, err := temporaltest.Start(ctx, temporaltest.Options{})
	if err != nil {
		return res, err
	}
	defer srv.Stop() // best effort at exit
	pool, err := ledgerworker.OpenPool(ctx, ledgerworker.Config{DatabaseURL: url, MaxConcurrentActivities: 64})
	if err != nil {
		return res, err
	}
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{Table: "dedup_temporal"})
	if err != nil {
		return res, err
	}
	if err := d.Migrate(ctx); err != nil {
		return res, err
	}
	c, err := srv.Dial()
	if err != nil {
		return res, err
	}
	defer c.Close()
	const taskQueue = "bench"
	w := worker.New(c, taskQueue, worker.Options{
		MaxConcurrentActivityExecutionSize: 64,
		// More pollers than the default 2, so that the dev server, not task
		// delivery, bounds the rate.
		MaxConcurrentActivityTaskPollers: 8,
		MaxConcurrentWorkflowTaskPollers: 8,
	})
	w.RegisterWorkflowWithOptions(fanOut, workflow.RegisterOptions{Name: "FanOut"})
	w.RegisterActivityWithOptions(func(ctx context.Context, in posting) (receipt, error) {
		var r receipt
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			r, err = effect(ctx, tx, in)
			return err
		})
		return r, err
	}, activity.RegisterOptions{Name: "Bare"})
	dedupactivity.Register(w, d, "Wrapped", effect)
	if err := w.Start(); err != nil {
		return res, err
	}
	defer w.Stop()

	const workflows = 8
	perMeasurement := total / workflows * workflows // what the workflows run
	measure := func(activityType string, round int) (time.Duration, error) {
		before := readCPU(meter)
		t0 := time.Now()
		runs := make([]client.WorkflowRun, workflows)
		for i := range workflows {
			id := fmt.Sprintf("bench-%s-%d-%d-%d", activityType, round, i, time.Now().UnixNano())
			run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: id, TaskQueue: taskQueue}, "FanOut", activityType, id, total/workflows)
			if err != nil {
				return 0, err
			}
			runs[i] = run
		}
		for _, r := range runs {
			if err := r.Get(ctx, nil); err != nil {
				return 0, err
			}
		}
		dt := time.Since(t0)
		after := readCPU(meter)
		if tc := res.cpu[activityType]; round >= 0 && tc != nil {
			var events int64
			for _, r := range runs { // after the readings: not measured
				desc, err := c.DescribeWorkflow(ctx, r.GetID(), r.GetRunID())
				if err != nil {
					return 0, err
				}
				events += desc.RawResponse.GetWorkflowExecutionInfo().GetHistoryLength()
			}
			tc.add(perMeasurement, events, before, after)
		}
		return dt, nil
	}
	for _, ty := range []string{"Bare", "Wrapped"} { // warm up
		if _, err := measure(ty, -1); err != nil {
			return res, err
		}
	}
	var bareT, wrappedT time.Duration
	for r := range res.rounds {
		var roundBare, roundWrapped time.Duration
		for _, ty := range []string{"Bare", "Wrapped", "Wrapped", "Bare"} {
			dt, err := measure(ty, r)
			if err != nil {
				return res, err
			}
			if ty == "Bare" {
				roundBare += dt
			} else {
				roundWrapped += dt
			}
		}
		bareT, wrappedT = bareT+roundBare, wrappedT+roundWrapped
		res.ratios = append(res.ratios, roundBare.Seconds()/roundWrapped.Seconds())
	}
	sort.Float64s(res.ratios)
	n := float64(perMeasurement * 2 * res.rounds)
	res.bare, res.wrapped = n/bareT.Seconds(), n/wrappedT.Seconds()
	return res, nil
}
