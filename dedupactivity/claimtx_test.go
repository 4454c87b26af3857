package dedupactivity_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// TestClaimTx: the lower-level form claims inside the caller's transaction;
// the marker commits with the caller's effect, and every misuse is named.
func TestClaimTx(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{ClaimWait: 5 * time.Second})
	ctx := context.Background()
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "order-1"}
	in := Transfer{Account: "a", Amount: 2}

	// deliver runs one delivery in a transaction of the caller's.
	deliver := func(in Transfer, complete bool) (Posting, dedupactivity.Outcome, error) {
		var out Posting
		var outcome dedupactivity.Outcome
		err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
			c, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, in)
			if err != nil {
				return err
			}
			outcome = c.Outcome()
			if outcome != dedupactivity.OutcomeClaimed {
				out = c.Stored()
				require.ErrorIs(t, c.Complete(ctx, out), dedupactivity.ErrNotClaimed)
				return nil
			}
			if out, err = b.post(ctx, tx, in); err != nil {
				return err
			}
			if !complete {
				return nil
			}
			// A Complete that failed before it was sent (its context
			// done) can be called again.
			cancelled, cancel := context.WithCancel(ctx)
			cancel()
			require.ErrorIs(t, c.Complete(cancelled, out), context.Canceled)
			if err := c.Complete(ctx, out); err != nil {
				return err
			}
			require.ErrorIs(t, c.Complete(ctx, out), dedupactivity.ErrNotClaimed, "twice")
			return nil
		})
		return out, outcome, err
	}

	first, outcome, err := deliver(in, true)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	dup, outcome, err := deliver(in, true)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, first, dup)
	_, _, err = deliver(Transfer{Account: "a", Amount: 3}, true)
	require.ErrorIs(t, err, dedupactivity.ErrPayloadMismatch)
	require.Equal(t, int64(1), b.ledgerRows(t))

	// The caller rolls back: nothing is marked, the next delivery claims.
	id = dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "order-2"}
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	c, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, in)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, c.Outcome())
	require.NoError(t, tx.Rollback(ctx))
	require.ErrorIs(t, c.Complete(ctx, Posting{}), pgx.ErrTxClosed)
	_, outcome, err = deliver(in, true)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)

	// Committed without Complete: marked, and later deliveries say so.
	id = dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "order-3"}
	_, _, err = deliver(in, false)
	require.NoError(t, err)
	_, _, err = deliver(in, true)
	require.ErrorIs(t, err, dedupactivity.ErrTxEnded)
	require.ErrorContains(t, err, "applied by a call outside an activity", "not by attempt 0")
	require.Equal(t, int64(3), b.ledgerRows(t))
	// Result says so too: applied, with no result to read.
	var stored Posting
	applied, err := b.d.Result(ctx, id, &stored)
	require.True(t, applied)
	require.ErrorIs(t, err, dedupactivity.ErrTxEnded)

	// The same event claimed twice in one transaction, before Complete:
	// said plainly, not taken for an effect that ended its transaction.
	id = dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "order-twice"}
	twice, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = twice.Rollback(ctx) }() // also if an assertion below fails
	_, err = dedupactivity.ClaimTx[Posting](ctx, b.d, twice, id, in)
	require.NoError(t, err)
	_, err = dedupactivity.ClaimTx[Posting](ctx, b.d, twice, id, in)
	require.ErrorContains(t, err, "already claimed in this transaction")
	require.NotErrorIs(t, err, dedupactivity.ErrTxEnded)
	require.NoError(t, twice.Rollback(ctx))

	// The same inside a savepoint (a nested pgx.Tx, as ORMs make), where
	// the marker's xmin is the subtransaction's, not the transaction's; and
	// the first claim in a savepoint, the second after it was released.
	for _, release := range []bool{false, true} {
		id = dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: fmt.Sprintf("order-savepoint-%v", release)}
		outer, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = outer.Rollback(ctx) }) // also if an assertion below fails
		sp, err := outer.Begin(ctx)
		require.NoError(t, err)
		_, err = dedupactivity.ClaimTx[Posting](ctx, b.d, sp, id, in)
		require.NoError(t, err)
		again := sp
		if release {
			require.NoError(t, sp.Commit(ctx)) // RELEASE SAVEPOINT
			again = outer
		}
		_, err = dedupactivity.ClaimTx[Posting](ctx, b.d, again, id, in)
		require.ErrorContains(t, err, "already claimed in this transaction", "released=%v", release)
		require.NotErrorIs(t, err, dedupactivity.ErrTxEnded)
		require.NoError(t, outer.Rollback(ctx))
	}

	// Complete in another transaction than the claim's.
	id = dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "order-4"}
	conn, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	tx, err = conn.Begin(ctx)
	require.NoError(t, err)
	c, err = dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, in)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "COMMIT; BEGIN")
	require.NoError(t, err)
	require.ErrorIs(t, c.Complete(ctx, Posting{}), dedupactivity.ErrTxEnded)
	require.NoError(t, tx.Rollback(ctx))

	// Inside a savepoint of the caller's (a nested pgx.Tx, as ORMs make).
	id = dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "order-5"}
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(outer pgx.Tx) error {
		return pgx.BeginFunc(ctx, outer, func(tx pgx.Tx) error {
			return b.claimAndPost(ctx, tx, id, in)
		})
	}))
	_, outcome, err = deliver(in, true)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)

	_, err = dedupactivity.ClaimTx[Posting](ctx, b.d, nil, id, in)
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
}

// TestClaimTxConcurrentUnderSerializable: a concurrent claim of the same
// event waits for the first transaction; under SERIALIZABLE its commit makes
// the waiter fail with a serialization failure (retry), under READ
// COMMITTED the waiter sees a duplicate.
func TestClaimTxConcurrentUnderSerializable(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{ClaimWait: 5 * time.Second})
	ctx := context.Background()
	for iso, want := range map[pgx.TxIsoLevel]string{pgx.Serializable: "40001", pgx.ReadCommitted: ""} {
		id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: string(iso)}
		tx1, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		c1, err := dedupactivity.ClaimTx[int](ctx, b.d, tx1, id, 1)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, c1.Outcome())

		done := make(chan error, 1)
		var outcome dedupactivity.Outcome
		go func() {
			done <- pgx.BeginTxFunc(ctx, b.pool, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) error {
				c2, err := dedupactivity.ClaimTx[int](ctx, b.d, tx, id, 1)
				if err == nil {
					outcome = c2.Outcome()
				}
				return err
			})
		}()
		time.Sleep(200 * time.Millisecond) // the second claim waits on the first
		require.NoError(t, c1.Complete(ctx, 7))
		require.NoError(t, tx1.Commit(ctx))
		err = <-done
		if want != "" {
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, want, pgErr.Code)
		} else {
			require.NoError(t, err)
			require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
		}
	}
}

// TestClaimTxTwiceWithResultsDiscarded: with DiscardResults every marker
// holds an empty result, so a marker of this very transaction, claimed and
// not completed, cannot be told by its result: claiming the event again
// before Complete fails saying so all the same (it was taken for a
// duplicate, which a caller acknowledges as applied, although the first
// claim's savepoint may still roll back and leave the event unapplied);
// after Complete it is a duplicate.
func TestClaimTxTwiceWithResultsDiscarded(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{DiscardResults: true})
	ctx := context.Background()
	in := Transfer{Account: "a", Amount: 2}
	for _, inSavepoint := range []bool{false, true} {
		id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: fmt.Sprintf("twice-%v", inSavepoint)}
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) }) // also if an assertion below fails
		first := tx
		if inSavepoint {
			first, err = tx.Begin(ctx)
			require.NoError(t, err)
		}
		c, err := dedupactivity.ClaimTx[Posting](ctx, b.d, first, id, in)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, c.Outcome())
		_, err = dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, in)
		require.ErrorContains(t, err, "already claimed in this transaction", "in a savepoint: %v", inSavepoint)
		require.NoError(t, tx.Rollback(ctx))
	}

	// Completed in this transaction: a duplicate.
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "completed"}
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		c, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, in)
		require.NoError(t, err)
		require.NoError(t, c.Complete(ctx, Posting{}))
		again, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, in)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeDuplicate, again.Outcome())
		return nil
	}))
}

// TestClaimTxRefusesThePartitionedLayout: ClaimTx takes no identity whose
// deliveries share a ScheduledTime, so the partitioned layout refuses it
// before anything is sent, naming the option.
func TestClaimTxRefusesThePartitionedLayout(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{PartitionInterval: time.Hour, Retention: time.Hour})
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "k"}
	_, err = dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, Transfer{Account: "a", Amount: 1})
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	require.ErrorContains(t, err, "PartitionInterval")
	var one int
	require.NoError(t, tx.QueryRow(ctx, `SELECT 1`).Scan(&one), "the caller's transaction is untouched")
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, b.markers(t))
}

// TestClaimTxOfTheEnclosingEvent: a ClaimTx, inside an effect, of the event
// that effect is applying is refused as claimed in this transaction, with
// results stored or discarded, whether the enclosing claim went first (a
// business key) or rode (a run-scoped first attempt: the ClaimTx's batch
// inserts the key first). With results discarded it was a duplicate: the
// effect skipped its writes and the enclosing claim committed a marker
// with no effect.
func TestClaimTxOfTheEnclosingEvent(t *testing.T) {
	t.Parallel()
	for _, discard := range []bool{false, true} {
		b := setup(t, dedupactivity.Options{DiscardResults: discard})
		for _, id := range []dedupactivity.Identity{
			{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "enclosing"},
			{Kind: dedupactivity.KindActivity, Namespace: "default", WorkflowID: "w", RunID: "r", ActivityID: "1"},
		} {
			ctx := context.Background()
			in := Transfer{Account: "a", Amount: 1}
			_, _, err := dedupactivity.Do(ctx, b.d, id, in, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				c, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, in)
				if err != nil {
					return Posting{}, err
				}
				if c.Outcome() != dedupactivity.OutcomeClaimed {
					return c.Stored(), nil // what a caller does with a duplicate
				}
				return b.post(ctx, tx, in)
			})
			require.ErrorContains(t, err, "already claimed in this transaction", "results discarded: %v, %s", discard, id.Kind)
			require.Zero(t, b.markers(t), "results discarded: %v, %s: nothing committed", discard, id.Kind)
			require.Zero(t, b.ledgerRows(t))
		}
	}
}

// TestClaimTxManyClaimsInOneTransaction: an open claim of a transaction is
// known as such however many other claims the transaction made; the
// connection forgot every open claim after 256, and claiming the first
// event again, whose claim a savepoint could still roll back, was then a
// duplicate (results discarded) or ErrTxEnded.
func TestClaimTxManyClaimsInOneTransaction(t *testing.T) {
	t.Parallel()
	for _, discard := range []bool{false, true} {
		b := setup(t, dedupactivity.Options{DiscardResults: discard})
		ctx := context.Background()
		id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "first"}
		in := Transfer{Account: "a", Amount: 1}
		tx, _ := claimInSavepoint(t, b, id, in) // its savepoint stays open
		for i := range 300 {
			other := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: fmt.Sprint("other-", i)}
			_, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, other, in)
			require.NoError(t, err)
		}
		_, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, in)
		require.ErrorContains(t, err, "already claimed in this transaction", "results discarded: %v", discard)
		require.NoError(t, tx.Rollback(ctx))
	}
}

// TestCompleteOfAClaimRolledBackBySQL: Complete updates its own event's
// marker, not whichever row took its place: a claim undone by ROLLBACK TO
// SAVEPOINT sent as SQL (as an ORM sends it) left a ctid that VACUUM gave
// to the next event's marker, and the stale Complete wrote its result
// there.
func TestCompleteOfAClaimRolledBackBySQL(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	e1 := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "E1"}
	e2 := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "E2"}
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	ctidOf := func(id dedupactivity.Identity) string {
		var ctid string
		require.NoError(t, tx.QueryRow(ctx, `SELECT ctid::text FROM dedup_marker WHERE id_hash = $1`, hashOf(id)).Scan(&ctid))
		return ctid
	}
	_, err = tx.Exec(ctx, `SAVEPOINT s`)
	require.NoError(t, err)
	c1, err := dedupactivity.ClaimTx[string](ctx, b.d, tx, e1, 1)
	require.NoError(t, err)
	ctid1 := ctidOf(e1)
	_, err = tx.Exec(ctx, `ROLLBACK TO SAVEPOINT s`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `VACUUM dedup_marker`)
	require.NoError(t, err)
	c2, err := dedupactivity.ClaimTx[string](ctx, b.d, tx, e2, 2)
	require.NoError(t, err)
	require.Equal(t, ctid1, ctidOf(e2), "the test's premise: E2's marker took E1's place")

	require.ErrorIs(t, c1.Complete(ctx, "result of E1"), dedupactivity.ErrTxEnded)
	require.NoError(t, c2.Complete(ctx, "result of E2"))
	require.NoError(t, tx.Commit(ctx))
	var got string
	found, err := b.d.Result(ctx, e2, &got)
	require.NoError(t, err)
	require.True(t, found)
	require.Equal(t, "result of E2", got)
	require.Equal(t, int64(1), b.markers(t))
}

// TestClaimTxOfTheEnclosingEventInAnotherTable: inside a wrapper's effect,
// a ClaimTx of the same identity through a Deduper of another table, which
// holds the event committed, is a duplicate there (results discarded): the
// connection's record of the wrapper's claim names its row (by xmin), not
// the identity alone.
func TestClaimTxOfTheEnclosingEventInAnotherTable(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	other, err := dedupactivity.New(b.pool, dedupactivity.Options{Table: "other_marker", DiscardResults: true})
	require.NoError(t, err)
	require.NoError(t, other.Migrate(ctx))
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "shared"}
	in := Transfer{Account: "a", Amount: 1}
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		c, err := dedupactivity.ClaimTx[Posting](ctx, other, tx, id, in)
		require.NoError(t, err)
		return c.Complete(ctx, Posting{})
	}))
	var inner dedupactivity.Outcome
	_, _, err = dedupactivity.Do(ctx, b.d, id, in, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		c, err := dedupactivity.ClaimTx[Posting](ctx, other, tx, id, in)
		if err != nil {
			return Posting{}, err
		}
		inner = c.Outcome()
		return b.post(ctx, tx, in)
	})
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, inner)
	require.Equal(t, int64(1), b.markers(t))
}

// TestClaimTxAfterItsSavepointRolledBack: a claim rolled back with its
// savepoint is not open any more: once another transaction committed the
// event, claiming it again in the first transaction is a duplicate, with
// results stored or discarded (discarded, it read as this transaction's
// open claim).
func TestClaimTxAfterItsSavepointRolledBack(t *testing.T) {
	t.Parallel()
	for _, discard := range []bool{false, true} {
		b := setup(t, dedupactivity.Options{DiscardResults: discard})
		ctx := context.Background()
		id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "rolled-back"}
		in := Transfer{Account: "a", Amount: 1}
		tx, sp := claimInSavepoint(t, b, id, in)
		require.NoError(t, sp.Rollback(ctx))
		_, outcome, err := dedupactivity.Do(ctx, b.d, id, in, b.post)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome, "committed by another transaction")
		again, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, in)
		require.NoError(t, err, "results discarded: %v", discard)
		require.Equal(t, dedupactivity.OutcomeDuplicate, again.Outcome())
		require.NoError(t, tx.Rollback(ctx))
	}
}

// claimInSavepoint begins a transaction, which the test's cleanup rolls
// back, and claims id in a savepoint of it.
func claimInSavepoint(t *testing.T, b *testBundle, id dedupactivity.Identity, in Transfer) (tx, sp pgx.Tx) {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	sp, err = tx.Begin(ctx)
	require.NoError(t, err)
	c, err := dedupactivity.ClaimTx[Posting](ctx, b.d, sp, id, in)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, c.Outcome())
	return tx, sp
}
