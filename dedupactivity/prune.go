package dedupactivity

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
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

// pruneBatchSize is how many expired markers one Prune statement deletes.
// Small batches keep each delete's locks and WAL short, so concurrent claims
// are not held up.
const pruneBatchSize = 1000

// Prune deletes expired markers (expires_at in the past) in batches of
// 1000, each in its own short transaction, until none are left or
// ctx is done. Rows locked by a concurrent pruner are skipped, so it is safe
// to run from many workers at once. It returns how many markers it deleted.
//
// In the partitioned layout it makes the partitions ahead, drops the
// partitions whose range is over and whose markers have all expired, and
// deletes expired rows of the default partition; each step runs whatever
// the others' errors, which it returns together. A partition whose lock it
// could not take within 500ms (a claim, or a reader, held the table that
// long) is left to the next run, unless its range starts within the next
// PartitionInterval: that error is returned.
func (d *Deduper) Prune(ctx context.Context) (int64, error) {
	n, _, err := d.prune(ctx, nil, time.Time{})
	return n, err
}

// prune is Prune, calling afterBatch (if not nil) with the running total
// after each batch and before each past partition is read. With a stopBy,
// it begins no batch and reads no partition after it, and says so
// (outOfTime).
func (d *Deduper) prune(ctx context.Context, afterBatch func(deleted int64), stopBy time.Time) (deleted int64, outOfTime bool, err error) {
	late := func() bool { return !stopBy.IsZero() && time.Now().After(stopBy) }
	var errs []error
	if d.opts.PartitionInterval > 0 {
		// The partitions ahead first, and each step whatever the others'
		// errors: a partition that cannot be dropped (say, read past the
		// role's statement_timeout) must not keep the ranges ahead from
		// being made, nor the default partition from being pruned.
		if _, err := d.ensurePartitions(ctx); err != nil {
			errs = append(errs, err)
		}
		n, err := d.dropExpiredPartitions(ctx, afterBatch, late)
		if err != nil {
			errs = append(errs, err)
		}
		deleted = n
		d.tel.markersPruned(ctx, n)
	}
	for {
		if late() {
			return deleted, true, errors.Join(errs...)
		}
		tag, err := d.pool.Exec(ctx, d.store.prune, pruneBatchSize)
		if err != nil {
			errs = append(errs, fmt.Errorf("dedupactivity: prune: %w", interpretError(err, false)))
			return deleted, false, errors.Join(errs...)
		}
		deleted += tag.RowsAffected()
		d.tel.markersPruned(ctx, tag.RowsAffected())
		if afterBatch != nil {
			afterBatch(deleted)
		}
		if tag.RowsAffected() < pruneBatchSize {
			return deleted, false, errors.Join(errs...)
		}
	}
}

// Names under which RegisterPruner registers the pruning workflow and
// activity. The activity name carries the table, so several Dedupers can
// prune through one worker.
const (
	pruneWorkflowName     = "DedupPrune"
	pruneActivityPrefix   = "DedupPrune:"
	pruneHeartbeatTimeout = time.Minute
	// pruneHeartbeatEvery is how often the prune activity heartbeats
	// besides after each batch: one statement (the read of a large expired
	// partition, a delete waiting for a lock) may outlast the heartbeat
	// timeout, which is there to find a worker that died, not a slow one.
	pruneHeartbeatEvery = pruneHeartbeatTimeout / 4
	// pruneStopBefore is how long before its deadline the prune activity
	// begins no batch: a run with a backlog longer than its StartToClose
	// timeout succeeds with OutOfTime, where a timed-out one is retried
	// and, three attempts later, fails.
	pruneStopBefore = time.Minute
)

// pruneActivityName is the name of d's prune activity.
func (d *Deduper) pruneActivityName() string { return pruneActivityPrefix + d.tel.table }

// PruneResult is what one run of the prune workflow (RegisterPruner) did;
// Deduper.Prune returns the count alone.
type PruneResult struct {
	// Deleted counts the markers deleted (rows and rows of dropped
	// partitions).
	Deleted int64
	// OutOfTime says the run stopped early, as its activity's time was
	// running out (see RegisterPruner): markers left to delete go in the
	// next run.
	OutOfTime bool
}

// RegisterPruner registers the pruning workflow and d's prune activity on a
// worker, so a Temporal Schedule (EnsurePruneSchedule) can run Prune on the
// same engine as everything else, visible in the Web UI. Call it once for
// each Deduper a worker prunes: the workflow is shared, the activity is d's.
// The activity (StartToClose one hour) runs Prune, heartbeating; with a
// backlog that would outlast it (pruning turned on for a large table), it
// begins no batch in its last minute and returns with OutOfTime set, so
// that the run succeeds and the next one goes on, where a timed-out run
// would be retried and fail. It panics if d was not made by New, as
// Register does.
func RegisterPruner(r worker.Registry, d *Deduper) {
	if !d.made() {
		panic("dedupactivity: RegisterPruner needs a Deduper made by New")
	}
	// The same function each time: registering it again is not a conflict.
	r.RegisterWorkflowWithOptions(pruneWorkflow, workflow.RegisterOptions{Name: pruneWorkflowName, DisableAlreadyRegisteredCheck: true})
	r.RegisterActivityWithOptions(d.pruneActivity, activity.RegisterOptions{Name: d.pruneActivityName()})
}

// pruneActivity prunes, heartbeating after each batch and every
// pruneHeartbeatEvery, with the count deleted so far, and begins nothing
// pruneStopBefore ahead of its deadline.
func (d *Deduper) pruneActivity(ctx context.Context) (PruneResult, error) {
	var stopBy time.Time
	if deadline := activity.GetInfo(ctx).Deadline; !deadline.IsZero() {
		stopBy = deadline.Add(-pruneStopBefore)
	}
	beat, stop := heartbeat.Start[int64](ctx, cmp.Or(d.pruneBeat, pruneHeartbeatEvery))
	defer stop()
	n, outOfTime, err := d.prune(ctx, beat, stopBy)
	return PruneResult{Deleted: n, OutOfTime: outOfTime}, err
}

// pruneWorkflow runs one pruning activity (its name is the input).
func pruneWorkflow(ctx workflow.Context, activityName string) (PruneResult, error) {
	ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{
		StartToCloseTimeout: time.Hour,
		HeartbeatTimeout:    pruneHeartbeatTimeout,
		RetryPolicy:         &temporal.RetryPolicy{MaximumAttempts: 3},
	})
	var res PruneResult
	err := workflow.ExecuteActivity(ctx, activityName).Get(ctx, &res)
	return res, err
}

// EnsurePruneSchedule creates, if it does not exist yet, a Temporal Schedule
// with the given ID that runs the pruning workflow (DedupPrune) for d every
// interval on taskQueue (where RegisterPruner registered it). Overlapping runs are
// skipped. It is idempotent and safe to call from every worker at start;
// when the Schedule exists with another interval or task queue, it is
// given these; its other settings stay. A Schedule with the ID that runs
// another Deduper's pruner (another table's: the ID given to two
// Dedupers) is left as it is, and the error wraps ErrInvalidOptions.
//
// interval must be at least 1m. In the partitioned layout it must also let
// two runs happen within the partitions made ahead (2 x interval <=
// PartitionsAhead x PartitionInterval), so that one run that cannot make
// them (see Prune) is made up for before deliveries reach a range without
// its partition, which sends them to the default partition for good; a
// longer one, however long, is refused with an error wrapping
// ErrInvalidOptions.
func EnsurePruneSchedule(ctx context.Context, c client.Client, d *Deduper, scheduleID, taskQueue string, interval time.Duration) error {
	switch {
	case !d.made():
		return fmt.Errorf("%w: EnsurePruneSchedule needs a Deduper made by New", ErrInvalidOptions)
	case c == nil:
		return fmt.Errorf("%w: the Temporal client is nil", ErrInvalidOptions)
	}
	if interval < time.Minute {
		return fmt.Errorf("%w: prune interval must be at least 1m, got %s", ErrInvalidOptions, interval)
	}
	// interval > ahead/2, not 2*interval > ahead: doubled, an interval past
	// 146 years wraps to a negative time.Duration, which passed.
	if ahead := time.Duration(d.opts.PartitionsAhead) * d.opts.PartitionInterval; ahead > 0 && interval > ahead/2 {
		return fmt.Errorf("%w: prune interval %s is more than half of what the partitions made ahead cover (PartitionsAhead %d x PartitionInterval %s): a run that cannot make them would leave deliveries without their partition; prune at least every %s, or raise PartitionsAhead",
			ErrInvalidOptions, interval, d.opts.PartitionsAhead, d.opts.PartitionInterval, ahead/2)
	}
	err := schedule.Ensure(ctx, c, client.ScheduleOptions{
		ID:      scheduleID,
		Spec:    client.ScheduleSpec{Intervals: []client.ScheduleIntervalSpec{{Every: interval}}},
		Overlap: enumspb.SCHEDULE_OVERLAP_POLICY_SKIP,
		Action: &client.ScheduleWorkflowAction{
			ID:        scheduleID,
			Workflow:  pruneWorkflowName,
			Args:      []any{d.pruneActivityName()},
			TaskQueue: taskQueue,
		},
	})
	if errors.Is(err, schedule.ErrTaken) {
		return fmt.Errorf("%w: ensure prune schedule for %s: %w", ErrInvalidOptions, d.pruneActivityName(), err)
	}
	if err != nil {
		return fmt.Errorf("dedupactivity: ensure prune schedule %q: %w", scheduleID, err)
	}
	return nil
}

// RedeliveryWarning says whether activity options let Temporal redeliver an
// activity later than retention after it was scheduled, in which case a
// late redelivery could find its marker pruned and apply the effect again.
// It returns "" when the options bound redelivery within retention. Call it
// at worker start for the options your workflows use, and log what it says.
//
// Redelivery is bounded by ScheduleToClose; without it, by MaximumAttempts
// times each attempt's ScheduleToStart (its wait in the task queue, say
// while no worker polls it) plus StartToClose plus the backoff. Without
// ScheduleToStart an attempt may wait in the queue without bound.
func RedeliveryWarning(activityType string, opts workflow.ActivityOptions, retention time.Duration) string {
	if opts.ScheduleToCloseTimeout > 0 {
		if opts.ScheduleToCloseTimeout > retention {
			return fmt.Sprintf("activity %s: ScheduleToClose %s exceeds the marker retention %s (markers are kept until ScheduleToClose anyway, but raise Retention to cover it)",
				activityType, opts.ScheduleToCloseTimeout, retention)
		}
		return ""
	}
	rp := opts.RetryPolicy
	if rp == nil || rp.MaximumAttempts == 0 {
		return fmt.Sprintf("activity %s: no ScheduleToClose and unlimited retries: Temporal may redeliver it after the marker retention %s; set ScheduleToCloseTimeout or RetryPolicy.MaximumAttempts",
			activityType, retention)
	}
	if opts.ScheduleToStartTimeout == 0 {
		return fmt.Sprintf("activity %s: no ScheduleToClose and no ScheduleToStart: an attempt may wait in the task queue without bound (while no worker polls it) and be delivered after the marker retention %s; set ScheduleToCloseTimeout",
			activityType, retention)
	}
	maxInterval := rp.MaximumInterval
	if maxInterval == 0 {
		maxInterval = 100 * max(rp.InitialInterval, time.Second)
	}
	// Saturated: the product may be more than a Duration holds, and
	// wrapped it would look within any retention.
	bound, perAttempt := time.Duration(math.MaxInt64), opts.ScheduleToStartTimeout+opts.StartToCloseTimeout+maxInterval
	if perAttempt <= bound/time.Duration(rp.MaximumAttempts) {
		bound = time.Duration(rp.MaximumAttempts) * perAttempt
	}
	if bound > retention {
		return fmt.Sprintf("activity %s: %d attempts may span up to %s, beyond the marker retention %s", activityType, rp.MaximumAttempts, bound, retention)
	}
	return ""
}
