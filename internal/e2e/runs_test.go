package e2e

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// DebitOnce is Debit with a business key (the transfer ID): once per
// transfer across runs.
const debitOnceName = "DebitOnce"

func registerRuns(r worker.Registry, d *dedupactivity.Deduper, pool *pgxpool.Pool) {
	dedupactivity.Register(r, d, debitOnceName, activities.DebitEffect,
		dedupactivity.WithBusinessKey(func(p activities.Posting) (string, error) { return p.TransferID, nil }))
	r.RegisterWorkflowWithOptions(twoDebitsWorkflow, workflow.RegisterOptions{Name: "TwoDebits"})
	r.RegisterWorkflowWithOptions(localAndRegularWorkflow, workflow.RegisterOptions{Name: "LocalAndRegular"})

	debit := dedupactivity.Wrap(d, activities.DebitEffect)
	debitOnce := dedupactivity.Wrap(d, activities.DebitEffect,
		dedupactivity.WithBusinessKey(func(p activities.Posting) (string, error) { return p.TransferID, nil }))
	r.RegisterActivityWithOptions(func(ctx context.Context, in localRetryInput) (activities.Receipt, error) {
		fn := debit
		if in.BusinessKey {
			fn = debitOnce
		}
		rc, err := fn(ctx, in.Posting)
		if err == nil && activity.GetInfo(ctx).Attempt == 1 {
			return rc, errors.New("failed after its effect committed") // a later step of the activity, say
		}
		return rc, err
	}, activity.RegisterOptions{Name: debitThenFailName})
	r.RegisterWorkflowWithOptions(localRetryWorkflow, workflow.RegisterOptions{Name: "LocalRetry"})
}

// DebitThenFail debits through Debit's effect, run-scoped or with the
// transfer ID as business key, and fails its first attempt after the
// effect committed.
const debitThenFailName = "DebitThenFail"

type localRetryInput struct {
	Posting     activities.Posting
	BusinessKey bool
	Backoff     time.Duration
}

// localRetryWorkflow runs DebitThenFail as a local activity whose retry
// waits in.Backoff.
func localRetryWorkflow(ctx workflow.Context, in localRetryInput) error {
	ctx = workflow.WithLocalActivityOptions(ctx, workflow.LocalActivityOptions{
		StartToCloseTimeout: 10 * time.Second,
		RetryPolicy:         &temporal.RetryPolicy{InitialInterval: in.Backoff, BackoffCoefficient: 1, MaximumAttempts: 2},
	})
	return workflow.ExecuteLocalActivity(ctx, debitThenFailName, in).Get(ctx, nil)
}

// TestLocalActivityRetries: a local activity retried within its workflow
// task (a backoff up to the WorkflowTaskTimeout) keeps its activity ID, so
// its retry is a duplicate of the attempt that committed; one retried
// through a workflow timer (a longer backoff) gets a new local activity ID
// from the SDK, so under its run-scoped identity the retry is a new event
// and the effect is applied again: the limit doc.go states, for which
// WithBusinessKey (or a RetryPolicy whose MaximumInterval stays within the
// WorkflowTaskTimeout) is the answer. Counted with SQL.
func TestLocalActivityRetries(t *testing.T) {
	t.Parallel()
	b := setup(t, registerRuns)
	for _, c := range []struct {
		name        string
		backoff     time.Duration
		businessKey bool
		debits      int64
	}{
		{"WithinTheWorkflowTask", 100 * time.Millisecond, false, 1},
		{"ThroughATimer", 2 * time.Second, false, 2},
		{"ThroughATimerWithABusinessKey", 2 * time.Second, true, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			id := "local-retry-" + c.name
			in := localRetryInput{Posting: activities.Posting{TransferID: id, Account: "alice", Amount: 1}, BusinessKey: c.businessKey, Backoff: c.backoff}
			run, err := b.client.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: id, TaskQueue: b.taskQueue, WorkflowTaskTimeout: time.Second}, "LocalRetry", in)
			require.NoError(t, err)
			require.NoError(t, run.Get(ctx, nil))
			require.Equal(t, c.debits, b.entries(t, id, "debit"))
		})
	}
}

type twoDebitsInput struct {
	TransferID string
	// ContinueOnce makes the first run continue-as-new after its debits.
	ContinueOnce bool
	// FailFirstRun makes the first run fail after its debits (the workflow
	// has a retry policy).
	FailFirstRun bool
	Iteration    int
}

// twoDebitsWorkflow debits alice through the run-scoped Debit and bob
// through the business-keyed DebitOnce.
func twoDebitsWorkflow(ctx workflow.Context, in twoDebitsInput) (string, error) {
	ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{StartToCloseTimeout: 10 * time.Second})
	p := activities.Posting{TransferID: in.TransferID, Account: "alice", Amount: 1}
	if err := workflow.ExecuteActivity(ctx, activities.DebitName, p).Get(ctx, nil); err != nil {
		return "", err
	}
	once := activities.Posting{TransferID: in.TransferID, Account: "bob", Amount: 1}
	if err := workflow.ExecuteActivity(ctx, debitOnceName, once).Get(ctx, nil); err != nil {
		return "", err
	}
	if in.ContinueOnce && in.Iteration == 0 {
		in.Iteration++
		return "", workflow.NewContinueAsNewError(ctx, twoDebitsWorkflow, in)
	}
	if in.FailFirstRun && workflow.GetInfo(ctx).Attempt == 1 {
		return "", errors.New("first run fails on purpose")
	}
	return workflow.GetInfo(ctx).WorkflowExecution.RunID, nil
}

// TestNewRunsAreNewEvents pins what happens when a new run reuses the same
// activity IDs: continue-as-new, workflow retry and reset each start a new
// run ID, so the run-scoped identity treats the new run's activity as a new
// event (applied again), while a business key applies once across runs.
func TestNewRunsAreNewEvents(t *testing.T) {
	t.Parallel()
	b := setup(t, registerRuns)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	start := func(id string, in twoDebitsInput, retry *temporal.RetryPolicy) client.WorkflowRun {
		run, err := b.client.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: id, TaskQueue: b.taskQueue, RetryPolicy: retry}, "TwoDebits", in)
		require.NoError(t, err)
		return run
	}
	check := func(id string) {
		t.Helper()
		require.Equal(t, int64(2), b.count(t, `SELECT count(*) FROM ledger_entry WHERE transfer_id = $1 AND account = 'alice'`, id),
			"run-scoped Debit applied once per run: two runs, two debits")
		require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM ledger_entry WHERE transfer_id = $1 AND account = 'bob'`, id),
			"business-keyed DebitOnce applied once across runs")
	}

	t.Run("ContinueAsNew", func(t *testing.T) {
		run := start("can", twoDebitsInput{TransferID: "can", ContinueOnce: true}, nil)
		firstRun := run.GetRunID()
		var lastRun string
		require.NoError(t, b.client.GetWorkflow(ctx, "can", "").Get(ctx, &lastRun))
		require.NotEqual(t, firstRun, lastRun)
		check("can")
	})
	t.Run("WorkflowRetry", func(t *testing.T) {
		run := start("retry", twoDebitsInput{TransferID: "retry", FailFirstRun: true},
			&temporal.RetryPolicy{InitialInterval: 100 * time.Millisecond, MaximumAttempts: 2})
		firstRun := run.GetRunID() // Get follows the chain and moves GetRunID along
		var lastRun string
		require.NoError(t, run.Get(ctx, &lastRun))
		require.NotEqual(t, firstRun, lastRun)
		check("retry")
	})
	t.Run("Reset", func(t *testing.T) {
		run := start("reset", twoDebitsInput{TransferID: "reset"}, nil)
		require.NoError(t, run.Get(ctx, nil))
		// Reset to the first workflow task: everything after it runs again
		// under a new run ID.
		resp, err := b.client.ResetWorkflowExecution(ctx, &workflowservice.ResetWorkflowExecutionRequest{
			Namespace:                 "default",
			WorkflowExecution:         workflowExecution("reset", run.GetRunID()),
			Reason:                    "e2e test",
			WorkflowTaskFinishEventId: firstWorkflowTaskCompleted(t, ctx, b.client, "reset", run.GetRunID()),
			RequestId:                 randomHex(),
		})
		require.NoError(t, err)
		require.NoError(t, b.client.GetWorkflow(ctx, "reset", resp.GetRunId()).Get(ctx, nil))
		check("reset")
	})
}

func workflowExecution(id, runID string) *commonpb.WorkflowExecution {
	return &commonpb.WorkflowExecution{WorkflowId: id, RunId: runID}
}

func firstWorkflowTaskCompleted(t *testing.T, ctx context.Context, c client.Client, id, runID string) int64 {
	t.Helper()
	it := c.GetWorkflowHistory(ctx, id, runID, false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	for it.HasNext() {
		e, err := it.Next()
		require.NoError(t, err)
		if e.GetEventType() == enumspb.EVENT_TYPE_WORKFLOW_TASK_COMPLETED {
			return e.GetEventId()
		}
	}
	t.Fatal("no WorkflowTaskCompleted event")
	return 0
}

// localAndRegularWorkflow runs Debit as a local activity (ID "1" from the
// local counter) and as a regular activity whose ID is forced to "1".
func localAndRegularWorkflow(ctx workflow.Context, transferID string) ([]activities.Receipt, error) {
	p := activities.Posting{TransferID: transferID, Account: "alice", Amount: 1}
	lctx := workflow.WithLocalActivityOptions(ctx, workflow.LocalActivityOptions{StartToCloseTimeout: 10 * time.Second})
	var local, regular activities.Receipt
	if err := workflow.ExecuteLocalActivity(lctx, activities.DebitName, p).Get(ctx, &local); err != nil {
		return nil, err
	}
	rctx := workflow.WithActivityOptions(ctx, workflow.ActivityOptions{StartToCloseTimeout: 10 * time.Second, ActivityID: "1"})
	if err := workflow.ExecuteActivity(rctx, activities.DebitName, p).Get(ctx, &regular); err != nil {
		return nil, err
	}
	return []activities.Receipt{local, regular}, nil
}

// TestLocalAndRegularActivityDoNotCollide: a local and a regular activity
// with the same activity ID in one run are two events.
func TestLocalAndRegularActivityDoNotCollide(t *testing.T) {
	t.Parallel()
	b := setup(t, registerRuns)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	run, err := b.client.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: "local-regular", TaskQueue: b.taskQueue}, "LocalAndRegular", "local-regular")
	require.NoError(t, err)
	var receipts []activities.Receipt
	require.NoError(t, run.Get(ctx, &receipts))
	require.Len(t, receipts, 2)
	require.NotEqual(t, receipts[0].EntryID, receipts[1].EntryID)
	require.Equal(t, int64(2), b.entries(t, "local-regular", "debit"))

	var ids, kinds []string
	for _, s := range b.spans.Ended() {
		if s.Name() != "Dedup:"+activities.DebitName {
			continue
		}
		for _, kv := range s.Attributes() {
			switch kv.Key {
			case "temporalActivityID":
				ids = append(ids, kv.Value.AsString())
			case dedupactivity.IdentityKindKey:
				kinds = append(kinds, kv.Value.AsString())
			}
		}
	}
	require.Equal(t, []string{"1", "1"}, ids, "both activities have activity ID 1")
	require.ElementsMatch(t, []string{"local_activity", "activity"}, kinds)
}
