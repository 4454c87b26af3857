package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
	"github.com/dedupactivity/dedupactivity/workflows"
)

// TestPruneSchedule: the worker creates the prune schedule (idempotently);
// a triggered run deletes expired markers and keeps live ones.
func TestPruneSchedule(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	_, err := b.transfer(t, workflows.TransferRequest{TransferID: "live", From: "alice", To: "bob", Amount: 1})
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `
INSERT INTO dedup_marker (id_hash, activity_type, attempt, expires_at)
SELECT sha256(int4send(g)), 'Old', 1, now() - interval '1 day'
FROM generate_series(1, 2500) g`)
	require.NoError(t, err)

	id := ledgerworker.PruneScheduleID(b.taskQueue)
	// A second worker start (or any caller) finds the schedule in place.
	require.NoError(t, dedupactivity.EnsurePruneSchedule(ctx, b.client, b.worker.Deduper, id, b.taskQueue, time.Hour))

	h := b.client.ScheduleClient().GetHandle(ctx, id)
	t.Cleanup(func() { _ = h.Delete(context.Background()) })
	require.NoError(t, h.Trigger(ctx, clientTrigger()))
	var workflowID, runID string
	require.Eventually(t, func() bool {
		desc, err := h.Describe(ctx)
		require.NoError(t, err)
		if len(desc.Info.RecentActions) == 0 {
			return false
		}
		a := desc.Info.RecentActions[0].StartWorkflowResult
		workflowID, runID = a.WorkflowID, a.FirstExecutionRunID
		return true
	}, 30*time.Second, 100*time.Millisecond)
	var res dedupactivity.PruneResult
	require.NoError(t, b.client.GetWorkflow(ctx, workflowID, runID).Get(ctx, &res))
	require.Equal(t, int64(2500), res.Deleted)
	require.Equal(t, int64(0), b.count(t, `SELECT count(*) FROM dedup_marker WHERE activity_type = 'Old'`))
	require.Equal(t, int64(2), b.count(t, `SELECT count(*) FROM dedup_marker`), "the live transfer's markers stay")
}

// TestScheduleIntervalFollowsTheLastStart: a Schedule made at an earlier
// start is given the interval a later start asks for (PRUNE_INTERVAL
// changed), its action kept; asking again for the same interval updates
// nothing; a start on another task queue moves the action there. The
// outbox's Schedules go through the same code.
func TestScheduleIntervalFollowsTheLastStart(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	id := ledgerworker.PruneScheduleID(b.taskQueue)
	h := b.client.ScheduleClient().GetHandle(ctx, id)
	t.Cleanup(func() { _ = h.Delete(context.Background()) })
	describe := func() *client.ScheduleDescription {
		desc, err := h.Describe(ctx)
		require.NoError(t, err)
		return desc
	}
	first := describe()
	require.Equal(t, []client.ScheduleIntervalSpec{{Every: time.Hour}}, first.Schedule.Spec.Intervals, "as the worker made it")

	require.NoError(t, dedupactivity.EnsurePruneSchedule(ctx, b.client, b.worker.Deduper, id, b.taskQueue, 2*time.Hour))
	changed := describe()
	require.Equal(t, []client.ScheduleIntervalSpec{{Every: 2 * time.Hour}}, changed.Schedule.Spec.Intervals)
	action, ok := changed.Schedule.Action.(*client.ScheduleWorkflowAction)
	require.True(t, ok)
	require.Equal(t, b.taskQueue, action.TaskQueue, "the action kept")
	require.Equal(t, first.Schedule.Action.(*client.ScheduleWorkflowAction).Workflow, action.Workflow)
	require.Len(t, action.Args, 1, "the activity's name, kept")
	require.Equal(t, first.Schedule.Policy.Overlap, changed.Schedule.Policy.Overlap, "the policies kept")

	require.NoError(t, dedupactivity.EnsurePruneSchedule(ctx, b.client, b.worker.Deduper, id, b.taskQueue, 2*time.Hour))
	require.Equal(t, changed.Info.LastUpdateAt, describe().Info.LastUpdateAt, "the same interval and action: not updated")

	// A start on another task queue (TASK_QUEUE changed, the Schedule's ID
	// kept) moves the action there: left on the old one, it would start
	// workflows no worker runs.
	require.NoError(t, dedupactivity.EnsurePruneSchedule(ctx, b.client, b.worker.Deduper, id, b.taskQueue+"-moved", 2*time.Hour))
	moved := describe().Schedule.Action.(*client.ScheduleWorkflowAction)
	require.Equal(t, b.taskQueue+"-moved", moved.TaskQueue)
	require.Equal(t, action.Workflow, moved.Workflow)
	require.Equal(t, action.Args, moved.Args, "the same arguments")
	require.NoError(t, dedupactivity.EnsurePruneSchedule(ctx, b.client, b.worker.Deduper, id, b.taskQueue, 2*time.Hour))
	require.Equal(t, b.taskQueue, describe().Schedule.Action.(*client.ScheduleWorkflowAction).TaskQueue, "and back")

	// The updated Schedule still runs the pruner: its arguments survived.
	require.NoError(t, h.Trigger(ctx, clientTrigger()))
	var run *client.ScheduleActionResult
	require.Eventually(t, func() bool {
		if recent := describe().Info.RecentActions; len(recent) > 0 {
			run = &recent[0]
		}
		return run != nil
	}, 30*time.Second, 100*time.Millisecond)
	var res dedupactivity.PruneResult
	require.NoError(t, b.client.GetWorkflow(ctx, run.StartWorkflowResult.WorkflowID, run.StartWorkflowResult.FirstExecutionRunID).Get(ctx, &res))
}

// TestScheduleIDTakenByAnotherPruner: a second Deduper (another table)
// given the prune Schedule's ID of the first is refused, and the Schedule
// keeps pruning the first table; otherwise each start would take the
// Schedule from the other, and one table would go unpruned.
func TestScheduleIDTakenByAnotherPruner(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	id := ledgerworker.PruneScheduleID(b.taskQueue)
	h := b.client.ScheduleClient().GetHandle(ctx, id)
	t.Cleanup(func() { _ = h.Delete(context.Background()) })
	args := func() []any {
		desc, err := h.Describe(ctx)
		require.NoError(t, err)
		return desc.Schedule.Action.(*client.ScheduleWorkflowAction).Args
	}
	before := args()

	other, err := dedupactivity.New(b.pool, dedupactivity.Options{Table: "other_marker"})
	require.NoError(t, err)
	err = dedupactivity.EnsurePruneSchedule(ctx, b.client, other, id, b.taskQueue, time.Hour)
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	require.ErrorContains(t, err, "dedup_marker")
	require.ErrorContains(t, err, "other_marker")
	require.Equal(t, before, args(), "the first table's pruner kept")
	require.NoError(t, dedupactivity.EnsurePruneSchedule(ctx, b.client, b.worker.Deduper, id, b.taskQueue, time.Hour), "its own Deduper still ensures it")
}
