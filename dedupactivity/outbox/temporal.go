package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/heartbeat"
	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/schedule"
)

// Names under which RegisterRelay, RegisterReconciler and RegisterPruner
// register their workflows. Activity names carry the outbox table
// (relayActivityName, reconcileActivityName, pruneActivityName), so one
// worker can serve several outboxes.
const (
	relayWorkflowName     = "DedupOutboxRelay"
	reconcileWorkflowName = "DedupOutboxReconcile"
	pruneWorkflowName     = "DedupOutboxPrune"
)

// made says whether ob was made by New: not nil, and not a zero Outbox.
func (ob *Outbox) made() bool { return ob != nil && ob.pool != nil }

// made says whether r was made by NewRelay.
func (r *Relay) made() bool { return r != nil && r.ob != nil }

// made says whether rc was made by NewReconciler.
func (rc *Reconciler) made() bool { return rc != nil && rc.ob != nil }

// pruneActivityName is the name of ob's prune activity.
func (ob *Outbox) pruneActivityName() string { return pruneWorkflowName + ":" + ob.name }

// relayActivityName is the name of r's relay activity.
func (r *Relay) relayActivityName() string { return relayWorkflowName + ":" + r.ob.name }

// reconcileActivityName is the name of rc's reconcile activity.
func (rc *Reconciler) reconcileActivityName() string {
	return reconcileWorkflowName + ":" + rc.ob.name
}

// RegisterRelay registers the relay workflow and relay's activity on a
// worker. The activity runs one pass (RunOnce), heartbeating after every
// message and every 30 seconds (a send may take up to its Lease), and
// returns its RelayResult; a pass that would outlast the
// activity's StartToClose timeout (30 minutes: a backlog after an outage)
// claims nothing in its last minute and one Lease, and returns with
// OutOfTime set, so that the run succeeds and the next one goes on, where a
// timed-out run would be retried and fail. EnsureRelaySchedule runs it from a
// Temporal Schedule, visible in the Web UI with every pass's result. Use it
// alone when a delivery delay of up to the schedule's interval is fine, or
// beside Run loops as a sweeper.
//
// It panics if relay was not made by NewRelay, as a worker's registration
// does on a bad activity, and if its Lease is over 28 minutes: the
// StartToClose less its last minute, and less a minute for the pass to
// reach its first claim. A longer Lease (29 minutes or more) would have
// every run claim nothing and return OutOfTime, for ever. Run loops outside
// Temporal take any Lease.
func RegisterRelay(r worker.Registry, relay *Relay) {
	if !relay.made() {
		panic("outbox: RegisterRelay needs a Relay made by NewRelay")
	}
	if relay.cfg.Lease > maxSweepStep {
		panic(fmt.Sprintf("outbox: RegisterRelay needs a Relay whose Lease is at most %s, got %s: the relay activity (StartToClose %s) claims nothing in its last minute and one Lease, so every run would claim nothing",
			maxSweepStep, relay.cfg.Lease, sweepStartToClose))
	}
	// The same function for every outbox: registering it again is not a
	// conflict.
	r.RegisterWorkflowWithOptions(sweep[RelayResult], workflow.RegisterOptions{Name: relayWorkflowName, DisableAlreadyRegisteredCheck: true})
	r.RegisterActivityWithOptions(relay.Activity, activity.RegisterOptions{Name: relay.relayActivityName()})
}

// Activity is the relay activity that RegisterRelay registers: one pass
// (RunOnce), heartbeating after every message, that ends before the
// activity's deadline (see RegisterRelay).
func (r *Relay) Activity(ctx context.Context) (RelayResult, error) {
	beat, stop := heartbeat.Start[RelayResult](ctx, cmp.Or(r.beatEvery, sweepHeartbeatEvery))
	defer stop()
	return r.runOnce(ctx, beat, sweepStop(ctx))
}

// sweepHeartbeatEvery is how often the relay and reconcile activities
// heartbeat besides after each message: one send or check may outlast the
// sweeps' HeartbeatTimeout (a Lease, or an HTTPChecker's Timeout, over two
// minutes), which is there to find a worker that died, not a slow step
// that its lease or timeout bounds.
const sweepHeartbeatEvery = 30 * time.Second

// The sweep activities' timeouts (withSweepOptions), the time they keep
// at the end of their StartToClose (sweepStop), and the longest step (a
// relay's Lease, an HTTPChecker's Timeout) that RegisterRelay and
// RegisterReconciler accept: one that the activity can still begin, its
// end before the stop, allowing a minute for the run to reach it (its
// first statements). A step of the StartToClose less the stop's minute, or
// more, is never begun: every run would do nothing and return OutOfTime.
const (
	sweepStartToClose = 30 * time.Minute
	sweepHeartbeat    = 2 * time.Minute
	sweepStopBefore   = time.Minute
	maxSweepStep      = sweepStartToClose - sweepStopBefore - time.Minute
)

// sweepStop is when a relay, reconcile or prune activity stops beginning
// work: a minute before its deadline, to give back what it leased, mark
// what it checked, and report. Zero without a deadline.
func sweepStop(ctx context.Context) time.Time {
	deadline := activity.GetInfo(ctx).Deadline
	if deadline.IsZero() {
		return time.Time{}
	}
	return deadline.Add(-sweepStopBefore)
}

// RegisterReconciler registers the reconcile workflow and rc's activity on a
// worker; the activity runs Reconcile, heartbeating before each check (and
// every 30 seconds with an HTTPChecker, whose Timeout bounds a check), and
// returns its ReconcileReport, with
// at most 500 keys listed in each of Rejected and Unresolved (see
// ReconcileReport.NotListed). A run that would outlast the activity's
// StartToClose timeout (30 minutes: many slow checks) asks nothing once a
// check begun could end within a minute of it (an HTTPChecker's checks
// take at most its Timeout), and returns with OutOfTime set.
//
// It panics if rc was not made by NewReconciler, and if its Checker is an
// HTTPChecker whose Timeout is over 28 minutes: the StartToClose less its
// last minute, and less a minute for the run to reach its first check. A
// longer Timeout (29 minutes or more) would have every run ask nothing and
// return OutOfTime, for ever. Reconcile called outside Temporal takes any
// Timeout.
func RegisterReconciler(r worker.Registry, rc *Reconciler) {
	if !rc.made() {
		panic("outbox: RegisterReconciler needs a Reconciler made by NewReconciler")
	}
	if rc.checkTime > maxSweepStep {
		panic(fmt.Sprintf("outbox: RegisterReconciler needs an HTTPChecker whose Timeout is at most %s, got %s: the reconcile activity (StartToClose %s) asks nothing once a check could end within a minute of its deadline, so every run would ask nothing",
			maxSweepStep, rc.checkTime, sweepStartToClose))
	}
	r.RegisterWorkflowWithOptions(sweep[ReconcileReport], workflow.RegisterOptions{Name: reconcileWorkflowName, DisableAlreadyRegisteredCheck: true})
	r.RegisterActivityWithOptions(rc.reconcileActivity, activity.RegisterOptions{Name: rc.reconcileActivityName()})
}

// PruneResult is what one run of the prune activity did.
type PruneResult struct {
	// Deleted counts the settled messages deleted.
	Deleted int64
	// OutOfTime says the run stopped early, as its activity's time was
	// running out: messages left to delete go in the next run.
	OutOfTime bool
}

// RegisterPruner registers the prune workflow and ob's prune activity on a
// worker. The activity runs Prune, heartbeating after each batch, and
// begins no batch in the last minute before its deadline (its result then
// says OutOfTime);
// EnsurePruneSchedule runs it from a Temporal Schedule, so sent, applied
// and rejected messages go once Options.Retention has passed instead of
// piling up. Call it once for each outbox a worker prunes. It panics if ob
// was not made by New.
func RegisterPruner(r worker.Registry, ob *Outbox) {
	if !ob.made() {
		panic("outbox: RegisterPruner needs an Outbox made by New")
	}
	r.RegisterWorkflowWithOptions(sweep[PruneResult], workflow.RegisterOptions{Name: pruneWorkflowName, DisableAlreadyRegisteredCheck: true})
	r.RegisterActivityWithOptions(ob.pruneActivity, activity.RegisterOptions{Name: ob.pruneActivityName()})
}

// pruneActivity prunes, heartbeating after each batch.
func (ob *Outbox) pruneActivity(ctx context.Context) (PruneResult, error) {
	n, outOfTime, err := ob.prune(ctx, func(deleted int64) { activity.RecordHeartbeat(ctx, deleted) }, sweepStop(ctx))
	return PruneResult{Deleted: n, OutOfTime: outOfTime}, err
}

// sweep is the relay, reconcile and prune workflows: it runs one activity
// (its name is the input) and returns its result.
func sweep[R any](ctx workflow.Context, activityName string) (R, error) {
	var res R
	err := workflow.ExecuteActivity(withSweepOptions(ctx), activityName).Get(ctx, &res)
	return res, err
}

func withSweepOptions(ctx workflow.Context) workflow.Context {
	return workflow.WithActivityOptions(ctx, workflow.ActivityOptions{
		StartToCloseTimeout: sweepStartToClose,
		HeartbeatTimeout:    sweepHeartbeat,
		RetryPolicy:         &temporal.RetryPolicy{MaximumAttempts: 3},
	})
}

// EnsureRelaySchedule creates, if it does not exist, a Schedule with the
// given ID that runs the relay workflow for r every interval on taskQueue (where
// RegisterRelay registered it). Overlapping runs are skipped. It is
// idempotent and safe to call from every worker at start; when the Schedule
// exists with another interval or task queue, it is given these; its other
// settings stay. A Schedule with the ID that runs other work (another
// outbox's relay, or a reconciler) is left as it is, and the error wraps
// ErrInvalidConfig, as does a nil r or c.
func EnsureRelaySchedule(ctx context.Context, c client.Client, r *Relay, scheduleID, taskQueue string, interval time.Duration) error {
	if !r.made() {
		return fmt.Errorf("%w: EnsureRelaySchedule needs a Relay made by NewRelay", ErrInvalidConfig)
	}
	return ensureSchedule(ctx, c, scheduleID, taskQueue, interval, relayWorkflowName, r.relayActivityName())
}

// EnsureReconcileSchedule is EnsureRelaySchedule for a Reconciler.
func EnsureReconcileSchedule(ctx context.Context, c client.Client, rc *Reconciler, scheduleID, taskQueue string, interval time.Duration) error {
	if !rc.made() {
		return fmt.Errorf("%w: EnsureReconcileSchedule needs a Reconciler made by NewReconciler", ErrInvalidConfig)
	}
	return ensureSchedule(ctx, c, scheduleID, taskQueue, interval, reconcileWorkflowName, rc.reconcileActivityName())
}

// EnsurePruneSchedule is EnsureRelaySchedule for ob's pruning (see
// RegisterPruner).
func EnsurePruneSchedule(ctx context.Context, c client.Client, ob *Outbox, scheduleID, taskQueue string, interval time.Duration) error {
	if !ob.made() {
		return fmt.Errorf("%w: EnsurePruneSchedule needs an Outbox made by New", ErrInvalidConfig)
	}
	return ensureSchedule(ctx, c, scheduleID, taskQueue, interval, pruneWorkflowName, ob.pruneActivityName())
}

func ensureSchedule(ctx context.Context, c client.Client, id, taskQueue string, interval time.Duration, wf, act string) error {
	if c == nil {
		return fmt.Errorf("%w: the Temporal client is nil", ErrInvalidConfig)
	}
	if interval < time.Second {
		return fmt.Errorf("%w: schedule interval must be at least 1s, got %s", ErrInvalidConfig, interval)
	}
	err := schedule.Ensure(ctx, c, client.ScheduleOptions{
		ID:      id,
		Spec:    client.ScheduleSpec{Intervals: []client.ScheduleIntervalSpec{{Every: interval}}},
		Overlap: enumspb.SCHEDULE_OVERLAP_POLICY_SKIP,
		Action:  &client.ScheduleWorkflowAction{ID: id, Workflow: wf, Args: []any{act}, TaskQueue: taskQueue},
	})
	if errors.Is(err, schedule.ErrTaken) {
		return fmt.Errorf("%w: ensure schedule: %w", ErrInvalidConfig, err)
	}
	if err != nil {
		return fmt.Errorf("outbox: ensure schedule %q: %w", id, err)
	}
	return nil
}
