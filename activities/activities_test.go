package activities_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func setup(t *testing.T) (*testsuite.TestActivityEnvironment, *pgtest.Schema) {
	t.Helper()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	d, err := dedupactivity.New(s.Pool, dedupactivity.Options{})
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	require.NoError(t, activities.Migrate(ctx, s.Pool))
	require.NoError(t, activities.Migrate(ctx, s.Pool), "migrating twice is harmless")
	require.NoError(t, activities.OpenAccounts(ctx, s.Pool, 100, "a", "b"))
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestActivityEnvironment()
	(&activities.Activities{Pool: s.Pool, Deduper: d}).Register(env)
	return env, s
}

func TestDebit(t *testing.T) {
	t.Parallel()
	env, s := setup(t)
	val, err := env.ExecuteActivity(activities.DebitName, activities.Posting{TransferID: "t", Account: "a", Amount: 30})
	require.NoError(t, err)
	var r activities.Receipt
	require.NoError(t, val.Get(&r))
	require.Equal(t, int64(70), r.Balance)
	require.Equal(t, int32(1), r.Attempt)
	var n int
	require.NoError(t, s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM ledger_entry WHERE kind = 'debit'`).Scan(&n))
	require.Equal(t, 1, n)
}

func TestDebitInsufficientFunds(t *testing.T) {
	t.Parallel()
	env, s := setup(t)
	_, err := env.ExecuteActivity(activities.DebitName, activities.Posting{TransferID: "t", Account: "a", Amount: 101})
	var appErr *temporal.ApplicationError
	require.ErrorAs(t, err, &appErr)
	require.Equal(t, "InsufficientFunds", appErr.Type())
	require.True(t, appErr.NonRetryable())
	var n int
	require.NoError(t, s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM ledger_entry`).Scan(&n))
	require.Zero(t, n, "rolled back")
}

func TestLoseCompletionCommitsThenFails(t *testing.T) {
	t.Parallel()
	env, s := setup(t)
	_, err := env.ExecuteActivity(activities.DebitName, activities.Posting{TransferID: "t", Account: "a", Amount: 1, Faults: activities.Faults{LoseCompletion: true}})
	require.ErrorContains(t, err, "completion lost")
	var n int
	require.NoError(t, s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM ledger_entry`).Scan(&n))
	require.Equal(t, 1, n, "the effect committed before the failure")
}

func TestAuditAndCheck(t *testing.T) {
	t.Parallel()
	_, s := setup(t)
	ctx := context.Background()
	_, err := s.Pool.Exec(ctx, `INSERT INTO ledger_entry (transfer_id, account, amount, kind, attempt) VALUES
		('ok', 'a', -1, 'debit', 1), ('ok', 'b', 1, 'credit', 1),
		('twice', 'a', -1, 'debit', 1), ('twice', 'a', -1, 'debit', 2), ('twice', 'b', 1, 'credit', 1),
		('half', 'a', -1, 'debit', 1)`)
	require.NoError(t, err)
	ledger, err := activities.Audit(ctx, s.Pool, []string{"ok", "twice", "half", "none"})
	require.NoError(t, err)

	ok := ledger["ok"]
	problem, double := ok.Check("ok", true, activities.Receipt{EntryID: ok.DebitID}, activities.Receipt{EntryID: ok.CreditID})
	require.Empty(t, problem)
	require.False(t, double)
	problem, _ = ok.Check("ok", true, activities.Receipt{EntryID: 999}, activities.Receipt{EntryID: ok.CreditID})
	require.Contains(t, problem, "do not match")

	problem, double = ledger["twice"].Check("twice", false, activities.Receipt{}, activities.Receipt{})
	require.True(t, double)
	require.Contains(t, problem, "applied twice")

	problem, double = ledger["half"].Check("half", true, activities.Receipt{}, activities.Receipt{})
	require.False(t, double)
	require.Contains(t, problem, "1 debits, 0 credits")
	problem, _ = ledger["none"].Check("none", false, activities.Receipt{}, activities.Receipt{})
	require.Empty(t, problem, "a transfer that never completed and applied nothing is fine")
}
