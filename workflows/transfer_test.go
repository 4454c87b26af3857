package workflows_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/mock"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/workflows"
)

// acts is an activities struct with no database: its methods are only
// registered and referenced, the mocks answer for them.
var acts = &activities.Activities{}

func newEnv(t *testing.T) *testsuite.TestWorkflowEnvironment {
	t.Helper()
	var s testsuite.WorkflowTestSuite
	env := s.NewTestWorkflowEnvironment()
	env.RegisterWorkflowWithOptions(workflows.TransferWorkflow, workflow.RegisterOptions{Name: workflows.TransferWorkflowName})
	// The activities struct, never called: the mocks decide results.
	env.RegisterActivity(acts)
	return env
}

func TestTransferWorkflowDebitsThenCredits(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	env.OnActivity(acts.Debit, mock.Anything, activities.Posting{TransferID: "t1", Account: "a", Amount: 5, Counterparty: "b"}).
		Run(func(args mock.Arguments) {
			info := activity.GetInfo(args.Get(0).(context.Context))
			assert.Equal(t, 10*time.Minute, info.ScheduleToCloseTimeout, "the debit gives up after ten minutes")
		}).
		Return(activities.Receipt{EntryID: 1, Account: "a", Balance: 95, Attempt: 1}, nil).Once()
	env.OnActivity(acts.Credit, mock.Anything, activities.Posting{TransferID: "t1", Account: "b", Amount: 5}).
		Run(func(args mock.Arguments) {
			info := activity.GetInfo(args.Get(0).(context.Context))
			assert.Equal(t, 24*time.Hour, info.ScheduleToCloseTimeout, "the credit, its debit applied, is retried for a day")
		}).
		Return(activities.Receipt{EntryID: 2, Account: "b", Balance: 105, Attempt: 1}, nil).Once()

	env.ExecuteWorkflow(workflows.TransferWorkflowName, workflows.TransferRequest{TransferID: "t1", From: "a", To: "b", Amount: 5})
	require.True(t, env.IsWorkflowCompleted())
	require.NoError(t, env.GetWorkflowError())
	var res workflows.TransferResult
	require.NoError(t, env.GetWorkflowResult(&res))
	require.Equal(t, int64(95), res.Debit.Balance)
	require.Equal(t, int64(105), res.Credit.Balance)
	env.AssertExpectations(t)
}

func TestTransferWorkflowRetriesThenFailsOnInsufficientFunds(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	env.OnActivity(acts.Debit, mock.Anything, mock.Anything).
		Return(activities.Receipt{}, errors.New("transient")).Once()
	env.OnActivity(acts.Debit, mock.Anything, mock.Anything).
		Return(activities.Receipt{}, temporal.NewNonRetryableApplicationError("insufficient funds", "InsufficientFunds", nil)).Once()

	env.ExecuteWorkflow(workflows.TransferWorkflowName, workflows.TransferRequest{TransferID: "t2", From: "a", To: "b", Amount: 500})
	require.True(t, env.IsWorkflowCompleted())
	var appErr *temporal.ApplicationError
	require.ErrorAs(t, env.GetWorkflowError(), &appErr)
	require.Equal(t, "InsufficientFunds", appErr.Type())
	env.AssertExpectations(t) // the transient failure was retried, the credit never ran
}

// TestTransferWorkflowUnknownAccountIsNotRetried: the debit's UnknownAccount
// (either account missing) ends the workflow at once; the credit never runs.
func TestTransferWorkflowUnknownAccountIsNotRetried(t *testing.T) {
	t.Parallel()
	env := newEnv(t)
	env.OnActivity(acts.Debit, mock.Anything, mock.Anything).
		Return(activities.Receipt{}, temporal.NewNonRetryableApplicationError("unknown account", activities.UnknownAccountType, nil)).Once()
	env.ExecuteWorkflow(workflows.TransferWorkflowName, workflows.TransferRequest{TransferID: "t3", From: "a", To: "nobody", Amount: 5})
	require.True(t, env.IsWorkflowCompleted())
	var appErr *temporal.ApplicationError
	require.ErrorAs(t, env.GetWorkflowError(), &appErr)
	require.Equal(t, activities.UnknownAccountType, appErr.Type())
	env.AssertExpectations(t)
}
