package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"go.temporal.io/sdk/temporal"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/workflows"
)

func TestTransfer(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	res, err := b.transfer(t, workflows.TransferRequest{TransferID: "t-plain", From: "alice", To: "bob", Amount: 10})
	require.NoError(t, err)
	require.Equal(t, int64(990), res.Debit.Balance)
	require.Equal(t, int64(1010), res.Credit.Balance)
	require.Equal(t, []string{"claimed"}, b.outcomes(activities.DebitName))
}

// TestTransferToUnknownAccount: a transfer to an account that does not
// exist fails at its debit, before money moves, and is not retried; before,
// the debit applied and the credit failed its foreign key until the
// activity's ScheduleToClose ran out, with the money in neither account.
func TestTransferToUnknownAccount(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.transfer(t, workflows.TransferRequest{TransferID: "t-unknown", From: "alice", To: "nobody", Amount: 30})
	var appErr *temporal.ApplicationError
	require.ErrorAs(t, err, &appErr)
	require.Equal(t, activities.UnknownAccountType, appErr.Type())
	require.Equal(t, int64(2000), b.count(t, `SELECT sum(balance) FROM account`), "money is conserved")
	require.Zero(t, b.count(t, `SELECT count(*) FROM ledger_entry WHERE transfer_id = 't-unknown'`))
	require.Equal(t, []string{"effect_error"}, b.outcomes(activities.DebitName), "one attempt, not retried")
}

// TestLostCompletion: the debit commits, then its attempt fails before
// reporting; Temporal retries; the retry is a duplicate and returns the
// first attempt's receipt; the ledger holds one debit.
func TestLostCompletion(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	res, err := b.transfer(t, workflows.TransferRequest{
		TransferID: "t-lost", From: "alice", To: "bob", Amount: 25,
		Faults: activities.Faults{LoseCompletion: true},
	})
	require.NoError(t, err)
	require.Equal(t, int32(1), res.Debit.Attempt, "the receipt is the first attempt's, returned by the retry")
	require.Equal(t, int64(975), res.Debit.Balance)
	require.Equal(t, int64(1), b.entries(t, "t-lost", "debit"))
	require.Equal(t, int64(1), b.entries(t, "t-lost", "credit"))
	require.Equal(t, int64(975), b.count(t, `SELECT balance FROM account WHERE id = 'alice'`))
	require.Equal(t, []string{"claimed", "duplicate"}, b.outcomes(activities.DebitName))

	// Both attempts' dedup spans sit in one trace, each under its own
	// RunActivity span (the Temporal tracing interceptor's).
	var dedup []trace.SpanContext
	parents := map[trace.SpanID]string{}
	for _, s := range b.spans.Ended() {
		parents[s.SpanContext().SpanID()] = s.Name()
	}
	var traceID trace.TraceID
	for _, s := range b.spans.Ended() {
		if s.Name() != "Dedup:"+activities.DebitName {
			continue
		}
		dedup = append(dedup, s.SpanContext())
		require.Equal(t, "RunActivity:"+activities.DebitName, parents[s.Parent().SpanID()])
		if traceID.IsValid() {
			require.Equal(t, traceID, s.SpanContext().TraceID(), "attempts share the workflow's trace")
		}
		traceID = s.SpanContext().TraceID()
	}
	require.Len(t, dedup, 2)
}

// TestOverlappingAttempts: attempt 1 of Credit is still in its transaction
// after its StartToClose timeout while attempt 2 starts; the credit is
// applied once and the workflow gets the committed receipt.
func TestOverlappingAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	res, err := b.transfer(t, workflows.TransferRequest{
		TransferID: "t-overlap", From: "alice", To: "bob", Amount: 40,
		StartToClose: 2 * time.Second,
		Faults:       activities.Faults{StallCredit: 3 * time.Second},
	})
	require.NoError(t, err)
	require.Equal(t, int64(1), b.entries(t, "t-overlap", "credit"))
	require.Equal(t, int64(1040), b.count(t, `SELECT balance FROM account WHERE id = 'bob'`))
	var entryID int64
	require.NoError(t, b.pool.QueryRow(context.Background(),
		`SELECT id FROM ledger_entry WHERE transfer_id = 't-overlap' AND kind = 'credit'`).Scan(&entryID))
	require.Equal(t, entryID, res.Credit.EntryID, "the workflow sees the committed entry")
	require.Greater(t, res.Credit.Attempt, int32(1), "a retry applied the credit")

	outcomes := b.outcomes(activities.CreditName)
	claimed := 0
	for _, o := range outcomes {
		if o == string(dedupactivity.OutcomeClaimed) {
			claimed++
		}
	}
	require.Equal(t, 1, claimed, "outcomes %v", outcomes)
	require.GreaterOrEqual(t, len(outcomes), 2, "outcomes %v", outcomes)
}
