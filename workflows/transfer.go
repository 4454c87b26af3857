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

// ActivityOptions are the options TransferWorkflow runs its debit with.
// ScheduleToClose bounds redelivery, so markers kept for the Deduper's
// retention (30 days by default) cover every possible redelivery; the worker
// checks this at start (dedupactivity.RedeliveryWarning).
func ActivityOptions(startToClose time.Duration) workflow.ActivityOptions {
	if startToClose == 0 {
		startToClose = 10 * time.Second
	}
	return workflow.ActivityOptions{
		StartToCloseTimeout:    startToClose,
		ScheduleToCloseTimeout: 10 * time.Minute,
		RetryPolicy: &temporal.RetryPolicy{
			InitialInterval:        200 * time.Millisecond,
			BackoffCoefficient:     2,
			MaximumInterval:        2 * time.Second,
			NonRetryableErrorTypes: []string{activities.InsufficientFundsType, activities.UnknownAccountType},
		},
	}
}

// CreditActivityOptions are the options TransferWorkflow runs its credit
// with: those of the debit, retried for a day instead of ten minutes. Once
// the debit is applied, giving up on the credit would leave the money in
// neither account, so a database outage is waited out; the debit has
// checked that the credited account exists.
func CreditActivityOptions(startToClose time.Duration) workflow.ActivityOptions {
	o := ActivityOptions(startToClose)
	o.ScheduleToCloseTimeout = 24 * time.Hour
	o.RetryPolicy.MaximumInterval = time.Minute
	return o
}

// TransferWorkflow debits one account and credits another, each through a
// dedup-wrapped activity. The debit fails, before money moves, when either
// account does not exist (UnknownAccount) or From lacks the funds
// (InsufficientFunds). Once the debit applied, the credit is retried until it
// applies, for up to its ScheduleToCloseTimeout (24h).
func TransferWorkflow(ctx workflow.Context, req TransferRequest) (TransferResult, error) {
	var res TransferResult
	debit := activities.Posting{TransferID: req.TransferID, Account: req.From, Amount: req.Amount, Counterparty: req.To, Faults: req.Faults}
	var a *activities.Activities // methods referenced by name; the worker holds the real one
	dctx := workflow.WithActivityOptions(ctx, ActivityOptions(req.StartToClose))
	if err := workflow.ExecuteActivity(dctx, a.Debit, debit).Get(ctx, &res.Debit); err != nil {
		return res, err
	}
	credit := activities.Posting{TransferID: req.TransferID, Account: req.To, Amount: req.Amount, Faults: req.Faults}
	cctx := workflow.WithActivityOptions(ctx, CreditActivityOptions(req.StartToClose))
	if err := workflow.ExecuteActivity(cctx, a.Credit, credit).Get(ctx, &res.Credit); err != nil {
		return res, err
	}
	return res, nil
}
