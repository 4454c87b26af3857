package activities_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/workflow"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func setup(t *testing.T) (*testsuite.TestActivityEnvironment, *pgtest.Schema) {
	env, s, _ := setupActs(t)
	return env, s
}

// setupActs migrates a schema of the test's own and registers the
// activities struct on an activity test environment, as a worker does.
func setupActs(t *testing.T) (*testsuite.TestActivityEnvironment, *pgtest.Schema, *activities.Activities) {
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
	acts := activities.New(d, nil)
	env.RegisterActivity(acts)
	return env, s, acts
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

// TestUnknownAccount: a debit whose counterparty or own account does not
// exist fails with the non-retryable UnknownAccount and writes nothing, so a
// transfer to an unknown account moves no money; a credit to one fails
// retryably.
func TestUnknownAccount(t *testing.T) {
	t.Parallel()
	env, s := setup(t)
	for _, c := range []struct {
		name    string
		posting activities.Posting
	}{
		{activities.DebitName, activities.Posting{TransferID: "t1", Account: "a", Amount: 5, Counterparty: "nobody"}},
		{activities.DebitName, activities.Posting{TransferID: "t2", Account: "nobody", Amount: 5, Counterparty: "b"}},
	} {
		_, err := env.ExecuteActivity(c.name, c.posting)
		var appErr *temporal.ApplicationError
		require.ErrorAs(t, err, &appErr, "%s %+v", c.name, c.posting)
		require.Equal(t, activities.UnknownAccountType, appErr.Type())
		require.True(t, appErr.NonRetryable())
		require.ErrorContains(t, err, `"nobody"`)
	}
	// A credit's unknown account is retried: its debit is applied.
	_, err := env.ExecuteActivity(activities.CreditName, activities.Posting{TransferID: "t3", Account: "nobody", Amount: 5})
	require.ErrorContains(t, err, `unknown account "nobody"`)
	var appErr *temporal.ApplicationError
	require.ErrorAs(t, err, &appErr)
	require.False(t, appErr.NonRetryable(), "a credit is retried")
	var entries, sum int64
	require.NoError(t, s.Pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM ledger_entry), (SELECT sum(balance) FROM account)`).Scan(&entries, &sum))
	require.Zero(t, entries, "rolled back")
	require.Equal(t, int64(200), sum, "no money moved")
	val, err := env.ExecuteActivity(activities.DebitName, activities.Posting{TransferID: "t4", Account: "a", Amount: 5, Counterparty: "b"})
	require.NoError(t, err, "a known counterparty")
	var r activities.Receipt
	require.NoError(t, val.Get(&r))
	require.Equal(t, int64(95), r.Balance)
}

// TestEnsureAccounts: accounts that exist keep their balance; the others
// are opened with the one given.
func TestEnsureAccounts(t *testing.T) {
	t.Parallel()
	_, s := setup(t) // a and b at 100
	ctx := context.Background()
	_, err := s.Pool.Exec(ctx, `UPDATE account SET balance = 42 WHERE id = 'a'`)
	require.NoError(t, err)
	require.NoError(t, activities.EnsureAccounts(ctx, s.Pool, 7, "a", "c"))
	var a, c int64
	require.NoError(t, s.Pool.QueryRow(ctx, `SELECT (SELECT balance FROM account WHERE id = 'a'), (SELECT balance FROM account WHERE id = 'c')`).Scan(&a, &c))
	require.Equal(t, int64(42), a, "kept")
	require.Equal(t, int64(7), c, "opened")
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

func (l ledgerCount) n(t *testing.T, kind string) int {
	t.Helper()
	var n int
	require.NoError(t, l.QueryRow(context.Background(), `SELECT count(*) FROM ledger_entry WHERE kind = $1`, kind).Scan(&n))
	return n
}

type ledgerCount struct{ *pgxpool.Pool }

// TestStructActivitiesRegisterAsUsual: the activities struct registers with
// RegisterActivity (and a name prefix), is called by method reference, and
// its wrapped methods are deduplicated: each event applies once.
func TestStructActivitiesRegisterAsUsual(t *testing.T) {
	t.Parallel()
	_, s, acts := setupActs(t)
	in := activities.Posting{TransferID: "t", Account: "a", Amount: 10}
	for range 2 { // by method reference; the second delivery is a duplicate
		// A new environment has the same workflow, run and activity IDs:
		// the same event.
		var suite testsuite.WorkflowTestSuite
		env := suite.NewTestActivityEnvironment()
		env.RegisterActivity(acts)
		val, err := env.ExecuteActivity(acts.Debit, in)
		require.NoError(t, err)
		var r activities.Receipt
		require.NoError(t, val.Get(&r))
		require.Equal(t, int64(90), r.Balance)
	}
	require.Equal(t, 1, ledgerCount{s.Pool}.n(t, "debit"))

	// Every test environment has the same IDs: a table of its own keeps
	// this event apart from the debit above.
	d, err := dedupactivity.New(s.Pool, dedupactivity.Options{Table: "prefixed"})
	require.NoError(t, err)
	require.NoError(t, d.Migrate(context.Background()))
	var suite testsuite.WorkflowTestSuite
	prefixed := suite.NewTestActivityEnvironment()
	prefixed.RegisterActivityWithOptions(activities.New(d, nil), activity.RegisterOptions{Name: "Ledger."})
	_, err = prefixed.ExecuteActivity("Ledger.Credit", activities.Posting{TransferID: "t", Account: "b", Amount: 1})
	require.NoError(t, err)
	require.Equal(t, 1, ledgerCount{s.Pool}.n(t, "credit"))
}

// localTwice runs Debit as a local activity twice in one workflow: two
// events (the local activity counter gives them different IDs).
func localTwice(ctx workflow.Context, in activities.Posting) ([]activities.Receipt, error) {
	ctx = workflow.WithLocalActivityOptions(ctx, workflow.LocalActivityOptions{StartToCloseTimeout: 10 * time.Second})
	var a *activities.Activities
	out := make([]activities.Receipt, 2)
	for i := range out {
		if err := workflow.ExecuteLocalActivity(ctx, a.Debit, in).Get(ctx, &out[i]); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// TestStructActivityAsLocalActivity: a method of the struct runs as a local
// activity, with a local-activity identity.
func TestStructActivityAsLocalActivity(t *testing.T) {
	t.Parallel()
	_, s, acts := setupActs(t)
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestWorkflowEnvironment()
	env.RegisterActivity(acts)
	env.RegisterWorkflow(localTwice)
	env.ExecuteWorkflow(localTwice, activities.Posting{TransferID: "t", Account: "a", Amount: 1})
	require.True(t, env.IsWorkflowCompleted())
	require.NoError(t, env.GetWorkflowError())
	var rs []activities.Receipt
	require.NoError(t, env.GetWorkflowResult(&rs))
	require.Equal(t, []int64{99, 98}, []int64{rs[0].Balance, rs[1].Balance})
	// The markers are those of local-activity identities.
	var hashes [][]byte
	for _, id := range []string{"1", "2"} {
		h := dedupactivity.Identity{Kind: dedupactivity.KindLocalActivity, Namespace: "default-test-namespace",
			WorkflowID: "default-test-workflow-id", RunID: "default-test-run-id", ActivityID: id}.Hash()
		hashes = append(hashes, h[:])
	}
	rows, err := s.Pool.Query(context.Background(), `SELECT id_hash FROM dedup_marker ORDER BY id_hash`)
	require.NoError(t, err)
	stored, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	require.NoError(t, err)
	require.ElementsMatch(t, hashes, stored, "want %x", hashes)
}
