package e2e

import (
	"context"
	"errors"
	"github.com/jackc/pgx/v5/pgxpool"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// TestPartitionedDuplicateAfterBoundary: in the partitioned layout, attempt
// 1 commits its effect and loses its completion; attempt 2 starts after the
// next partition boundary. ScheduledTime is the same for both attempts on
// the real server, so the retry finds the marker and is a duplicate.
func TestPartitionedDuplicateAfterBoundary(t *testing.T) {
	t.Parallel()
	const interval = 2 * time.Second
	var (
		mu        sync.Mutex
		scheduled []time.Time
		started   []time.Time
		dp        *dedupactivity.Deduper
	)
	b := setup(t, func(r worker.Registry, _ *dedupactivity.Deduper, pool *pgxpool.Pool) {
		var err error
		dp, err = dedupactivity.New(pool, dedupactivity.Options{Table: "dedup_part", PartitionInterval: interval, PartitionsAhead: 5})
		require.NoError(t, err)
		require.NoError(t, dp.Migrate(context.Background()))
		wrapped := dedupactivity.Wrap(dp, activities.CreditEffect)
		r.RegisterActivityWithOptions(func(ctx context.Context, in activities.Posting) (activities.Receipt, error) {
			info := activity.GetInfo(ctx)
			mu.Lock()
			scheduled = append(scheduled, info.ScheduledTime)
			started = append(started, time.Now())
			mu.Unlock()
			rec, err := wrapped(ctx, in)
			if err == nil && info.Attempt == 1 {
				// Lose the completion, and make the retry start in the next
				// partition interval.
				next := time.Now().Truncate(interval).Add(interval)
				time.Sleep(time.Until(next) + 200*time.Millisecond)
				return activities.Receipt{}, errors.New("injected: completion lost")
			}
			return rec, err
		}, activity.RegisterOptions{Name: "CreditPart"})
		r.RegisterWorkflowWithOptions(func(ctx workflow.Context, in activities.Posting) (activities.Receipt, error) {
			ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{
				StartToCloseTimeout: 20 * time.Second,
				RetryPolicy:         &temporal.RetryPolicy{InitialInterval: 100 * time.Millisecond},
			})
			var rec activities.Receipt
			err := workflow.ExecuteActivity(ctx, "CreditPart", in).Get(ctx, &rec)
			return rec, err
		}, workflow.RegisterOptions{Name: "CreditPartWorkflow"})
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	run, err := b.client.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: "part", TaskQueue: b.taskQueue}, "CreditPartWorkflow",
		activities.Posting{TransferID: "part", Account: "bob", Amount: 5})
	require.NoError(t, err)
	var rec activities.Receipt
	require.NoError(t, run.Get(ctx, &rec))

	require.Len(t, scheduled, 2)
	require.True(t, scheduled[0].Equal(scheduled[1]), "ScheduledTime is stable across attempts: %v vs %v", scheduled[0], scheduled[1])
	require.NotEqual(t, started[0].Truncate(interval), started[1].Truncate(interval), "the retry ran in a later partition interval")
	require.Equal(t, int32(1), rec.Attempt, "the retry returned the first attempt's receipt")
	require.Equal(t, int64(1), b.entries(t, "part", "credit"), "the effect applied once")
	var part string
	var markers int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT min(tableoid::regclass::text), count(*) FROM dedup_part`).Scan(&part, &markers))
	require.Equal(t, 1, markers)
	require.NotEqual(t, "dedup_part_default", part)
}
