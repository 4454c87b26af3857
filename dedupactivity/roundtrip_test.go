package dedupactivity_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// TestRoundTrips pins the cost of the claim: a first delivery takes no more
// round trips than the bare effect in a transaction (one fewer when the
// claim rides with the effect's first statement), and a duplicate fewer.
func TestRoundTrips(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()

	d, pool, writes := countingDeduper(t, b, nil)

	measure := func(f func(i int)) int64 {
		f(-1) // warm up: connect, prepare statements
		before := writes.Load()
		f(0)
		return writes.Load() - before
	}
	bare := measure(func(int) {
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := b.post(ctx, tx, Transfer{Account: "a", Amount: 1})
			return err
		}))
	})
	first := measure(func(i int) {
		id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: fmt.Sprint("first", i)}
		_, outcome, err := dedupactivity.Do(ctx, d, id, Transfer{Account: "a", Amount: 1}, b.post)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	})
	dup := measure(func(int) {
		id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "first-1"}
		_, outcome, err := dedupactivity.Do(ctx, d, id, Transfer{Account: "a", Amount: 1}, b.post)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	})
	riding := measure(func(i int) {
		_, outcome, err := dedupactivity.Do(ctx, d, runScoped(fmt.Sprint("riding", i)), Transfer{Account: "a", Amount: 1}, b.post)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	})
	ridingDup := measure(func(int) {
		_, outcome, err := dedupactivity.Do(ctx, d, runScoped("riding0"), Transfer{Account: "a", Amount: 1}, b.post)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	})
	t.Logf("round trips: bare %d, first delivery %d (claim riding: %d), duplicate %d (claim riding: %d)", bare, first, riding, dup, ridingDup)
	require.Equal(t, int64(4), bare, "BEGIN, INSERT, UPDATE, COMMIT")
	require.Equal(t, bare, first, "a first delivery costs the round trips of the bare transaction")
	require.Equal(t, bare-1, riding, "one fewer when the claim rides with the first statement")
	require.Equal(t, int64(2), dup, "a duplicate: claim; rollback and read")
	require.Equal(t, int64(2), ridingDup, "a duplicate whose claim rode: claim and statement; rollback and read")
}
