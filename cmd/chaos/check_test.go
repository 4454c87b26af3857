package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/workflows"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestCheckCountsLostCompletionsFromTheLedger: a debit's lost completion
// fired only if its first attempt committed (a first attempt that waited
// past its StartToClose on a row lock rolled back, and its retry was a
// first claim). The check counts the fired ones with SQL, and a run in
// which none fired is a violation: its "nothing applied twice" would hold
// without a redelivery to test it.
func TestCheckCountsLostCompletionsFromTheLedger(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	require.NoError(t, activities.Migrate(ctx, s.Pool))
	names := make([]string, accounts)
	for i := range names {
		names[i] = fmt.Sprintf("acct-%02d", i)
	}
	require.NoError(t, activities.OpenAccounts(ctx, s.Pool, balance, names...))
	r := &rig{ledger: s.Pool}

	// transfers: one losing its debit's completion, whose debit committed
	// at debitAttempt, and one without faults.
	transfers := func(prefix string, debitAttempt int) *drained {
		d := &drained{}
		for i, lose := range []bool{true, false} {
			id := fmt.Sprintf("%s-%d", prefix, i)
			attempt := 1
			if lose {
				attempt = debitAttempt
			}
			var res workflows.TransferResult
			require.NoError(t, s.Pool.QueryRow(ctx, `INSERT INTO ledger_entry (transfer_id, account, amount, kind, attempt)
				VALUES ($1, 'acct-00', -1, 'debit', $2) RETURNING id`, id, attempt).Scan(&res.Debit.EntryID))
			require.NoError(t, s.Pool.QueryRow(ctx, `INSERT INTO ledger_entry (transfer_id, account, amount, kind, attempt)
				VALUES ($1, 'acct-01', 1, 'credit', 1) RETURNING id`, id).Scan(&res.Credit.EntryID))
			d.runs = append(d.runs, transfer{req: workflows.TransferRequest{TransferID: id, Faults: activities.Faults{LoseCompletion: lose}}})
			d.results = append(d.results, res)
			d.errs = append(d.errs, nil)
		}
		return d
	}

	rep := &report{WantMoney: accounts * balance}
	require.NoError(t, checkLedger(ctx, r, transfers("fired", 1), rep))
	require.Empty(t, rep.Violations)
	require.EqualValues(t, 1, rep.LostCompletions)
	require.EqualValues(t, 1, rep.LostCompletionsFired)

	_, err := s.Pool.Exec(ctx, `TRUNCATE ledger_entry`)
	require.NoError(t, err)
	rep = &report{WantMoney: accounts * balance}
	require.NoError(t, checkLedger(ctx, r, transfers("rolled-back", 2), rep))
	require.EqualValues(t, 1, rep.LostCompletions)
	require.Zero(t, rep.LostCompletionsFired)
	require.Len(t, rep.Violations, 1)
	require.True(t, strings.Contains(rep.Violations[0], "did not fire"), rep.Violations[0])
}
