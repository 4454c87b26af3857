// Package workflows holds the example ledger's workflows.
package workflows

import (
	"time"

	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/activities"
)

// TransferWorkflowName is the name TransferWorkflow is registered under.
const TransferWorkflowName = "TransferWorkflow"

// TransferRequest moves Amount from From to To.
type TransferRequest struct {
	TransferID string
	From, To   string
	Amount     int64
	// StartToClose bounds each activity attempt. Defaults to 10s.
	StartToClose time.Duration
	// Faults provokes redeliveries (see activities.Faults).
	Faults activities.Faults
}

// TransferResult carries both receipts. Each receipt's Attempt is the
// attempt that applied the effect; when a later attempt returned it (a
// duplicate delivery), it is lower than that attempt's number.
type TransferResult struct {
	Debit  activities.Receipt
	Credit activities.Receipt
}

// TransferWorkflow debits one account and credits another, each through a
// dedup-wrapped activity.
func TransferWorkflow(ctx workflow.Context, req TransferRequest) (TransferResult, error) {
	stc := req.StartToClose
	if stc == 0 {
		stc = 10 * time.Second
	}
	ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{
		StartToCloseTimeout: stc,
		RetryPolicy: &temporal.RetryPolicy{
			InitialInterval:        200 * time.Millisecond,
			BackoffCoefficient:     2,
			MaximumInterval:        2 * time.Second,
			NonRetryableErrorTypes: []string{"InsufficientFunds"},
		},
	})
	var res TransferResult
	debit := activities.Posting{TransferID: req.TransferID, Account: req.From, Amount: req.Amount, Faults: req.Faults}
	if err := workflow.ExecuteActivity(ctx, activities.DebitName, debit).Get(ctx, &res.Debit); err != nil {
		return res, err
	}
	credit := activities.Posting{TransferID: req.TransferID, Account: req.To, Amount: req.Amount, Faults: req.Faults}
	if err := workflow.ExecuteActivity(ctx, activities.CreditName, credit).Get(ctx, &res.Credit); err != nil {
		return res, err
	}
	return res, nil
}
