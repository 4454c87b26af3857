package dedupactivity_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// runScoped is a run-scoped identity outside Temporal: its claim rides with
// the effect's first statement (Attempt is 0 in Do).
func runScoped(activityID string) dedupactivity.Identity {
	return dedupactivity.Identity{Kind: dedupactivity.KindActivity, Namespace: "default", WorkflowID: "w", RunID: "r", ActivityID: activityID}
}

// bothPaths are, by subtest name, a business key from key, whose claim
// goes first, and a run-scoped identity from key, whose claim rides.
func bothPaths(key string) map[string]dedupactivity.Identity {
	return map[string]dedupactivity.Identity{
		"ClaimFirst": {Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: key},
		"Riding":     runScoped(key),
	}
}

// TestEveryFirstCallWorks: whatever the effect calls first, a first delivery
// applies it once and a duplicate applies nothing and returns the stored
// result. Statements with positional arguments carry the claim (two round
// trips in all for a one-statement effect); other calls send the claim on
// its own first. Either way the first call of a duplicate fails.
func TestEveryFirstCallWorks(t *testing.T) {
	t.Parallel()
	const insert = `INSERT INTO ledger (account, amount) VALUES ($1, $2) RETURNING id`
	calls := []struct {
		name  string
		rides bool
		call  func(ctx context.Context, tx pgx.Tx) (int64, error)
	}{
		{"Exec", true, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			tag, err := tx.Exec(ctx, insert, "a", 1)
			return tag.RowsAffected(), err
		}},
		{"QueryRow", true, func(ctx context.Context, tx pgx.Tx) (id int64, err error) {
			return id, tx.QueryRow(ctx, insert, "a", 1).Scan(&id)
		}},
		{"Query", true, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			rows, _ := tx.Query(ctx, insert, "a", 1) // pgx's pattern: the error comes with the rows
			ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				return 0, err
			}
			return ids[0], nil
		}},
		{"QueryLeftOpen", true, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			rows, err := tx.Query(ctx, insert, "a", 1)
			if err != nil {
				return 0, err
			}
			return 1, rows.Err() // never read nor closed: the claim closes it
		}},
		{"ExecWithoutArguments", false, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			tag, err := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ('a', 1); SELECT 1`)
			return tag.RowsAffected(), err
		}},
		{"NamedArgs", false, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			tag, err := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES (@account, @amount)`, pgx.NamedArgs{"account": "a", "amount": 1})
			return tag.RowsAffected(), err
		}},
		{"ExecMode", false, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			tag, err := tx.Exec(ctx, insert, pgx.QueryExecModeSimpleProtocol, "a", 1)
			return tag.RowsAffected(), err
		}},
		{"Savepoint", false, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return 0, err
			}
			if _, err := sp.Exec(ctx, insert, "a", 1); err != nil {
				return 0, err
			}
			return 1, sp.Commit(ctx)
		}},
		{"SendBatch", false, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			b := &pgx.Batch{}
			b.Queue(insert, "a", 1)
			return 1, tx.SendBatch(ctx, b).Close()
		}},
		{"CopyFrom", false, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			return tx.CopyFrom(ctx, pgx.Identifier{"ledger"}, []string{"account", "amount"}, pgx.CopyFromRows([][]any{{"a", int64(1)}}))
		}},
		{"Prepare", false, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			if _, err := tx.Prepare(ctx, "ride_insert", insert); err != nil {
				return 0, err
			}
			tag, err := tx.Exec(ctx, "ride_insert", "a", 1)
			return tag.RowsAffected(), err
		}},
		{"Conn", false, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			tag, err := tx.Conn().Exec(ctx, insert, "a", 1) // on a duplicate Conn is nil: the panic is the claim's
			return tag.RowsAffected(), err
		}},
		{"LargeObjects", false, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			lo := tx.LargeObjects()
			if _, err := lo.Create(ctx, 0); err != nil {
				return 0, err
			}
			tag, err := tx.Exec(ctx, insert, "a", 1)
			return tag.RowsAffected(), err
		}},
	}
	// With the simple protocol, one call may send several statements, so
	// nothing rides.
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		for _, c := range calls {
			t.Run(mode.String()+"/"+c.name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, dedupactivity.Options{})
				d, _, writes := countingDeduper(t, b, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
				ctx := context.Background()
				var sawDuplicate atomic.Bool
				fn := func(ctx context.Context, tx pgx.Tx, in Transfer) (int64, error) {
					n, err := c.call(ctx, tx)
					if errors.Is(err, dedupactivity.ErrDuplicate) {
						sawDuplicate.Store(true)
					}
					return n, err
				}
				// Warm the connection and its statement cache on another event.
				_, _, err := dedupactivity.Do(ctx, d, runScoped("warm"), Transfer{}, fn)
				require.NoError(t, err)
				before := writes.Load()
				first, outcome, err := dedupactivity.Do(ctx, d, runScoped("1"), Transfer{}, fn)
				require.NoError(t, err)
				require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
				if rt := writes.Load() - before; c.rides && mode != pgx.QueryExecModeSimpleProtocol {
					require.Equal(t, int64(2), rt, "BEGIN, claim and the statement; result and COMMIT")
				} else {
					require.Greater(t, rt, int64(2), "the claim went on its own")
				}

				again, outcome, err := dedupactivity.Do(ctx, d, runScoped("1"), Transfer{}, fn)
				require.NoError(t, err)
				require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
				require.Equal(t, first, again, "the stored result")
				// The claim is sent when the effect first calls the Tx, so that
				// call says the delivery is a duplicate (Conn returns nil, and
				// LargeObjects fail: their panics are the claim's).
				// Under the simple protocol the claim goes before the effect,
				// which a duplicate then never runs.
				want := mode != pgx.QueryExecModeSimpleProtocol && c.name != "Conn" && c.name != "LargeObjects"
				require.Equal(t, want, sawDuplicate.Load(), "the first call of a duplicate returned ErrDuplicate")
				require.Equal(t, int64(2), b.ledgerRows(t), "one row for each event, none for the duplicate")
				require.Equal(t, int64(2), b.markers(t))
			})
		}
	}
}

// TestDuplicateWhoseClaimRode: on a duplicate whose claim rode with the
// effect's first statement, that statement returns ErrDuplicate; whatever
// the effect then does (returns the error, ignores it, panics on it) is
// rolled back and ignored, and the delivery returns the stored result.
func TestDuplicateWhoseClaimRode(t *testing.T) {
	t.Parallel()
	for _, then := range []string{"ReturnsTheError", "IgnoresIt", "Panics", "WritesOn"} {
		t.Run(then, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			var seen []error
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				p, err := b.post(ctx, tx, in)
				if err == nil {
					return p, nil
				}
				seen = append(seen, err)
				switch then {
				case "IgnoresIt":
					return Posting{EntryID: -1}, nil
				case "Panics":
					panic(err)
				case "WritesOn":
					_, err2 := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2)`, "b", 100)
					seen = append(seen, err2)
					return Posting{EntryID: -1}, nil
				}
				return p, err
			})
			in := Transfer{Account: "a", Amount: 4}
			first, err := deliver(t, "Post", fn, in) // attempt 1 of a run-scoped identity: the claim rides
			require.NoError(t, err)
			again, err := deliver(t, "Post", fn, in)
			require.NoError(t, err)
			require.Equal(t, first, again, "the stored result")
			require.NotEmpty(t, seen)
			for _, err := range seen {
				require.ErrorIs(t, err, dedupactivity.ErrDuplicate)
			}
			require.Equal(t, int64(1), b.ledgerRows(t))
			require.Equal(t, int64(4), b.count(t, `SELECT sum(balance) FROM account`))
		})
	}
}

// TestClaimTimeoutWhileRiding: a riding claim whose marker, inserted with
// COMMIT, waits past the claim wait for another attempt that holds the
// event fails with ErrClaimTimeout, and nothing of it commits.
func TestClaimTimeoutWhileRiding(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	holding, release := holdFirstClaim(t, b) // b.d claims first: it has a hook
	rider, err := dedupactivity.New(b.pool, dedupactivity.Options{ClaimWait: 300 * time.Millisecond})
	require.NoError(t, err)
	in := Transfer{Account: "a", Amount: 2}
	holder := make(chan error, 1)
	go func() { _, err := deliver(t, "Post", dedupactivity.Wrap(b.d, b.post), in); holder <- err }()
	<-holding

	began := time.Now()
	_, err = deliver(t, "Post", dedupactivity.Wrap(rider, b.post), in)
	require.ErrorIs(t, err, dedupactivity.ErrClaimTimeout)
	require.Less(t, time.Since(began), 10*time.Second)
	require.Zero(t, b.ledgerRows(t), "the rider's writes rolled back; the holder's are not committed yet")
	release()
	require.NoError(t, <-holder)
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(2), b.count(t, `SELECT balance FROM account WHERE id = 'a'`))
}

// TestFirstStatementDeadlineIsTheEffects: the effect's first statement,
// sent with the claim, waits on a row lock until the caller's deadline:
// that is the effect's error (the look waits for nothing), not a claim
// timeout, and nothing commits, also when the effect swallows the
// statement's error and returns success (OutcomeEffectError either way).
func TestFirstStatementDeadlineIsTheEffects(t *testing.T) {
	t.Parallel()
	for name, swallow := range map[string]bool{"Returned": false, "Swallowed": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			ctx := context.Background()
			lock, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			defer lock.Rollback(ctx)
			_, err = lock.Exec(ctx, `SELECT balance FROM account WHERE id = 'a' FOR UPDATE`)
			require.NoError(t, err)

			dctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			defer cancel()
			_, outcome, err := dedupactivity.Do(dctx, b.d, runScoped("deadline"), Transfer{Account: "a", Amount: 1},
				func(ctx context.Context, tx pgx.Tx, in Transfer) (int64, error) {
					var balance int64
					err := tx.QueryRow(ctx, `UPDATE account SET balance = balance + $2 WHERE id = $1 RETURNING balance`, in.Account, in.Amount).Scan(&balance)
					if swallow {
						require.Error(t, err)
						return 0, nil
					}
					return balance, err
				})
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.NotErrorIs(t, err, dedupactivity.ErrClaimTimeout)
			require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
			require.NoError(t, lock.Rollback(ctx))
			require.Zero(t, b.markers(t))
			require.Zero(t, b.count(t, `SELECT balance FROM account WHERE id = 'a'`))
		})
	}
}

// TestFirstStatementWithAnExpiredContext: an effect whose context ran out
// before its first statement (slow work of its own first) gets the
// context's error from that statement, as from pgx, and the attempt is
// OutcomeEffectError, whether the claim's statements are prepared on the
// connection yet or not. It is no claim timeout: nothing was sent, and no
// other attempt held the event. A later delivery applies the effect.
func TestFirstStatementWithAnExpiredContext(t *testing.T) {
	t.Parallel()
	for name, warm := range map[string]bool{"NewConnection": false, "Prepared": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			ctx := context.Background()
			d, _, _ := countingDeduper(t, b, nil) // one connection
			in := Transfer{Account: "a", Amount: 1}
			if warm {
				_, _, err := dedupactivity.Do(ctx, d, runScoped("warm"), in, b.post)
				require.NoError(t, err)
			}
			short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
			defer cancel()
			_, outcome, err := dedupactivity.Do(short, d, runScoped("x"), in, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				<-ctx.Done() // slow work of the effect's own, before any statement
				return b.post(ctx, tx, in)
			})
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.NotErrorIs(t, err, dedupactivity.ErrClaimTimeout)
			require.Equal(t, dedupactivity.OutcomeEffectError, outcome, "%v", err)

			_, outcome, err = dedupactivity.Do(ctx, d, runScoped("x"), in, b.post)
			require.NoError(t, err)
			require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
			want := int64(1)
			if warm {
				want = 2
			}
			require.Equal(t, want, b.ledgerRows(t))
		})
	}
}

// TestConcurrentRidingDeliveries: first attempts of one run-scoped event
// delivered at once all look, find nothing and run the effect; the first
// marker inserted with COMMIT wins, the others fail on its key (an ERROR in
// the server log: Temporal does not run one attempt twice at once) and
// return the stored result.
func TestConcurrentRidingDeliveries(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{ClaimWait: 20 * time.Second})
	ctx := context.Background()
	const n = 8
	outcomes := make([]dedupactivity.Outcome, n)
	results := make([]Posting, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			var err error
			results[i], outcomes[i], err = dedupactivity.Do(ctx, b.d, runScoped("1"), Transfer{Account: "b", Amount: 3}, b.post)
			assert.NoError(t, err)
		}()
	}
	close(start)
	wg.Wait()
	claimed := 0
	for i, o := range outcomes {
		if o == dedupactivity.OutcomeClaimed {
			claimed++
		}
		require.Equal(t, results[0], results[i], "every delivery returns the committed result")
	}
	require.Equal(t, 1, claimed)
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(3), b.count(t, `SELECT balance FROM account WHERE id = 'b'`))
}

// TestWhichClaimsRide: only first attempts of regular and standalone
// activities' run-scoped identities ride; retries, business keys and local
// activities claim first.
func TestWhichClaimsRide(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		kind    dedupactivity.Kind
		attempt int32
		rides   bool
	}{
		{dedupactivity.KindActivity, 0, true}, // Do outside an activity
		{dedupactivity.KindActivity, 1, true},
		{dedupactivity.KindActivity, 2, false},
		{dedupactivity.KindStandalone, 1, true},
		{dedupactivity.KindStandalone, 3, false},
		{dedupactivity.KindLocalActivity, 1, false},
		{dedupactivity.KindBusinessKey, 0, false},
		{dedupactivity.KindBusinessKey, 1, false},
	} {
		got := dedupactivity.MayRide(dedupactivity.Identity{Kind: c.kind}, activity.Info{Attempt: c.attempt})
		require.Equal(t, c.rides, got, fmt.Sprintf("%s, attempt %d", c.kind, c.attempt))
	}
}

// TestFirstStatementPgxRefuses: when pgx refuses the effect's first
// statement before sending anything (it cannot be prepared, or its
// arguments cannot be encoded), the effect sees that statement's own error,
// not a claim error, and nothing commits.
func TestFirstStatementPgxRefuses(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			d, _, _ := countingDeduper(t, b, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			firstStatementRefused(t, b, d)
		})
	}
}

func firstStatementRefused(t *testing.T, b *testBundle, d *dedupactivity.Deduper) {
	ctx := context.Background()
	for name, c := range map[string]struct {
		sql  string
		args []any
	}{
		"MissingTable":   {`INSERT INTO no_such_table (x) VALUES ($1)`, []any{1}},
		"UnencodableArg": {`INSERT INTO ledger (account, amount) VALUES ($1, $2)`, []any{"a", struct{ X chan int }{}}},
	} {
		var seen error
		_, outcome, err := dedupactivity.Do(ctx, d, runScoped(name), Transfer{}, func(ctx context.Context, tx pgx.Tx, _ Transfer) (int, error) {
			_, err := tx.Exec(ctx, c.sql, c.args...)
			seen = err
			return 0, err
		})
		require.Error(t, err, name)
		require.Equal(t, dedupactivity.OutcomeEffectError, outcome, "%s: %v", name, err)
		require.ErrorIs(t, err, seen, "%s: the effect's error, unchanged", name)
		require.NotErrorIs(t, err, dedupactivity.ErrNotMigrated, name)
	}
	require.Zero(t, b.markers(t))
	require.Zero(t, b.ledgerRows(t))
}

// TestRowsConnInsertsTheKeyFirst: the connection of a riding statement's
// Rows is the Tx's Conn, so a COMMIT sent on it after the look commits the
// marker's key with the effect's writes, as for tx.Conn(): never applied
// twice.
func TestRowsConnInsertsTheKeyFirst(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	fn := func(ctx context.Context, tx pgx.Tx, in Transfer) (int64, error) {
		rows, _ := tx.Query(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2) RETURNING id`, in.Account, in.Amount)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return 0, err
		}
		conn := rows.Conn()
		if conn == nil {
			return 0, errors.New("no connection")
		}
		_, err = conn.Exec(ctx, `COMMIT; BEGIN; INSERT INTO ledger (account, amount) VALUES ('b', 100)`)
		return ids[0], err
	}
	for range 2 {
		_, _, err := dedupactivity.Do(ctx, b.d, runScoped("1"), Transfer{Account: "a", Amount: 1}, fn)
		require.ErrorIs(t, err, dedupactivity.ErrTxEnded)
	}
	require.Equal(t, int64(1), b.ledgerRows(t), "the write before the COMMIT, once")
	require.Equal(t, int64(1), b.markers(t), "committed with it")
}

// TestBeforeConnectSimpleProtocolDoesNotRide: a pool whose BeforeConnect
// hook switches connections to the simple protocol gets no riding claims,
// though its own configuration says otherwise.
func TestBeforeConnectSimpleProtocolDoesNotRide(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	d, _, writes := countingDeduper(t, b, func(c *pgxpool.Config) {
		c.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
			cc.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
			return nil
		}
	})
	_, _, err := dedupactivity.Do(ctx, d, runScoped("warm"), Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)
	before := writes.Load()
	_, outcome, err := dedupactivity.Do(ctx, d, runScoped("1"), Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	require.Equal(t, int64(4), writes.Load()-before, "the claim went first: BEGIN and claim, two statements, result and COMMIT")
}

// TestEffectErrorBeforeAnyStatementIsTheEffects: an effect whose claim may
// ride and that returns its own error before sending any statement (its
// context ran out in work of its own) gets that error back, unchanged, as
// OutcomeEffectError: the claim sent after it only looks for a duplicate,
// and its failure on the dead context is not a claim timeout.
func TestEffectErrorBeforeAnyStatementIsTheEffects(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	errOwn := errors.New("fetching rates")
	for _, cancelIt := range []bool{false, true} {
		t.Run(fmt.Sprintf("Cancelled=%v", cancelIt), func(t *testing.T) {
			dctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			defer cancel()
			_, outcome, err := dedupactivity.Do(dctx, b.d, runScoped(fmt.Sprint("own-", cancelIt)), Transfer{Account: "a", Amount: 1},
				func(ctx context.Context, tx pgx.Tx, in Transfer) (int64, error) {
					if cancelIt {
						cancel()
					}
					<-ctx.Done() // work of its own, until the deadline
					return 0, fmt.Errorf("%w: %w", errOwn, ctx.Err())
				})
			require.ErrorIs(t, err, errOwn)
			require.NotErrorIs(t, err, dedupactivity.ErrClaimTimeout)
			require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
		})
	}
	require.Zero(t, b.markers(t))
}

// TestDuplicateWhoseEffectFailedBeforeAnyStatement: on a first attempt the
// claim waits for the effect's first statement; an effect that returns an
// error before sending any makes the claim go on its own after it, and when
// that claim finds the event applied the delivery is a duplicate: it returns
// the stored result, not the effect's error (which came from a run that
// could apply nothing), and nothing more is written.
func TestDuplicateWhoseEffectFailedBeforeAnyStatement(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	id := runScoped("fails-before-statements")
	first, outcome, err := dedupactivity.Do(ctx, b.d, id, Transfer{Account: "a", Amount: 3}, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)

	errOwn := errors.New("rates service down")
	again, outcome, err := dedupactivity.Do(ctx, b.d, id, Transfer{Account: "a", Amount: 3},
		func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
			return Posting{}, errOwn // before any statement
		})
	require.NoError(t, err, "a duplicate returns the stored result, not the effect's error")
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, first, again)
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(3), b.count(t, `SELECT balance FROM account WHERE id = 'a'`))
	require.Equal(t, int64(1), b.markers(t))
}

// TestRidingDuplicateUndoesSessionSettings: what a riding duplicate's first
// statement did outside its transaction stays (a sequence's nextval), but
// a session-level set_config does not: PostgreSQL undoes it with the
// rollback, so the pooled connection keeps the setting it had.
func TestRidingDuplicateUndoesSessionSettings(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	d, pool, _ := countingDeduper(t, b, nil) // one connection: the duplicate's
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE SEQUENCE ride_seq`)
	require.NoError(t, err)
	fn := func(ctx context.Context, tx pgx.Tx, in Transfer) (string, error) {
		var s string
		err := tx.QueryRow(ctx, `SELECT set_config('application_name', $1, false) || nextval('ride_seq')`, in.Account).Scan(&s)
		return s, err
	}
	_, outcome, err := dedupactivity.Do(ctx, d, runScoped("session"), Transfer{Account: "first"}, fn)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	got, outcome, err := dedupactivity.Do(ctx, d, runScoped("session"), Transfer{Account: "again"}, fn)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, "first1", got)
	var name string
	var last int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT current_setting('application_name'), last_value FROM ride_seq`).Scan(&name, &last))
	require.Equal(t, "first", name, "the duplicate's set_config was rolled back")
	require.Equal(t, int64(2), last, "the duplicate's nextval stays")
}

// TestFirstStatementDeadlineKeepsTheEffectsError: when the deadline comes
// while the effect's first statement rides with the claim (sent, or being
// prepared), the attempt returns what the effect returned, as for any other
// failed statement, not the statement's bare error: the effect's own
// wrapping (here errOwn) reaches the caller.
func TestFirstStatementDeadlineKeepsTheEffectsError(t *testing.T) {
	t.Parallel()
	errOwn := errors.New("debit refused")
	for _, prepared := range []bool{false, true} {
		t.Run(fmt.Sprintf("Prepared=%v", prepared), func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			ctx := context.Background()
			d, pool, _ := countingDeduper(t, b, nil) // one connection
			_, err := pool.Exec(ctx, `CREATE TABLE locked (id int)`)
			require.NoError(t, err)
			in := Transfer{Account: "a", Amount: 1}
			_, _, err = dedupactivity.Do(ctx, d, runScoped("warm"), in, b.post) // the claim's statements prepared
			require.NoError(t, err)
			stmt := `INSERT INTO locked (id) VALUES ($1)`
			if !prepared {
				// Prepared here, then held by a row lock when it runs.
				_, _, err = dedupactivity.Do(ctx, d, runScoped("warm2"), in, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
					_, err := tx.Exec(ctx, `UPDATE account SET balance = balance + $1 WHERE id = 'a'`, 1)
					return 0, err
				})
				require.NoError(t, err)
				stmt = `UPDATE account SET balance = balance + $1 WHERE id = 'a'`
				holder, err := b.pool.Begin(ctx)
				require.NoError(t, err)
				t.Cleanup(func() { _ = holder.Rollback(ctx) })
				_, err = holder.Exec(ctx, `SELECT 1 FROM account WHERE id = 'a' FOR UPDATE`)
				require.NoError(t, err)
			} else {
				lockTable(t, b, "locked")
			}
			short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			defer cancel()
			_, outcome, err := dedupactivity.Do(short, d, runScoped("x"), in, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
				if _, err := tx.Exec(ctx, stmt, 1); err != nil {
					return 0, fmt.Errorf("%w: %w", errOwn, err)
				}
				return 0, nil
			})
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.ErrorIs(t, err, errOwn, "the effect's own error")
			require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
		})
	}
}

// TestRidingRowsKeptPastTheAttempt: an effect that returns with its riding
// statement's Rows unread and keeps them: the claim closes them as it ends,
// and a later Close of the kept Rows, while another attempt uses the
// connection, touches nothing of that attempt (-race) and tells a pgx
// tracer nothing more.
func TestRidingRowsKeptPastTheAttempt(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	spy := &batchTracer{}
	pool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 1; cfg.ConnConfig.Tracer = spy })
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)
	ctx := context.Background()
	var kept []pgx.Rows
	keep := func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
		rows, err := tx.Query(ctx, `SELECT g FROM generate_series(1, $1::int) g`, in.Amount)
		kept = append(kept, rows)
		return 0, err
	}
	for i := range 2 {
		_, outcome, err := dedupactivity.Do(ctx, d, runScoped(fmt.Sprint("k", i)), Transfer{Account: "a", Amount: 3}, keep)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	}
	spy.mu.Lock()
	told := len(spy.queried)
	spy.mu.Unlock()
	kept[0].Close()
	spy.mu.Lock()
	require.Equal(t, told, len(spy.queried), "a kept Rows' Close tells the tracer nothing more")
	spy.mu.Unlock()

	done := make(chan struct{})
	go func() {
		defer close(done)
		kept[1].Close()
	}()
	_, _, err = dedupactivity.Do(ctx, d, runScoped("k-next"), Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)
	<-done
	require.Equal(t, int64(1), b.ledgerRows(t))
}

// TestEventAppliedBetweenTheLookAndTheKey: on a first attempt the claim
// rides as a look, and a call without bind parameters (here COMMIT) first
// inserts the marker's key. When another delivery committed the event
// between the look and that call, the key's insert finds it: the call fails
// as a duplicate's, nothing of this attempt commits (its COMMIT never
// runs, so its first write does not commit beside the other delivery's),
// and the attempt returns the stored result. Counted by SQL.
func TestEventAppliedBetweenTheLookAndTheKey(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	id := runScoped("between")
	in := Transfer{Account: "a", Amount: 7}
	var other Posting
	got, outcome, err := dedupactivity.Do(context.Background(), b.d, id, in, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		// Rides: the look finds no marker.
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2)`, in.Account, in.Amount); err != nil {
			return Posting{}, err
		}
		// Another delivery of the event, on another connection, applies
		// it meanwhile.
		var o dedupactivity.Outcome
		var err error
		other, o, err = dedupactivity.Do(context.Background(), b.d, id, in, b.post)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, o)
		_, err = tx.Exec(ctx, "COMMIT")
		require.Error(t, err, "the key's insert found the committed marker: COMMIT is not sent")
		return Posting{}, err
	})
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, other, got, "the other delivery's result")
	require.Equal(t, int64(1), b.ledgerRows(t), "applied once")
	require.Equal(t, int64(7), b.count(t, `SELECT balance FROM account WHERE id = 'a'`))
	require.Equal(t, int64(1), b.markers(t))
}

// TestClaimWaitUnderTheHeartbeatTimeout: the claim sends no heartbeat while
// it waits for a concurrent attempt, so an activity with a HeartbeatTimeout
// waits at most 80% of it and fails with a retryable claim timeout, before
// Temporal would time the attempt out for its missing heartbeats (and
// schedule the next while this one still waits).
func TestClaimWaitUnderTheHeartbeatTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	key := dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return "order-" + in.Account, nil })
	holding, release := holdFirstClaim(t, b)
	in := Transfer{Account: "a", Amount: 2}
	holder := make(chan error, 1)
	go func() { _, err := deliver(t, "Post", dedupactivity.Wrap(b.d, b.post, key), in); holder <- err }()
	<-holding

	waiter, err := dedupactivity.New(b.pool, dedupactivity.Options{ClaimWait: time.Minute})
	require.NoError(t, err)
	const heartbeat = 4 * time.Second
	var s testsuite.WorkflowTestSuite
	env := s.NewTestWorkflowEnvironment()
	env.SetTestTimeout(time.Minute) // its default, 3s, is below the wait
	env.RegisterActivityWithOptions(dedupactivity.Wrap(waiter, b.post, key), activity.RegisterOptions{Name: "Post"})
	began := time.Now()
	env.ExecuteWorkflow(func(ctx workflow.Context, in Transfer) error {
		ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{StartToCloseTimeout: 2 * time.Minute,
			HeartbeatTimeout: heartbeat, RetryPolicy: &temporal.RetryPolicy{MaximumAttempts: 1}})
		return workflow.ExecuteActivity(ctx, "Post", in).Get(ctx, nil)
	}, in)
	waited := time.Since(began)
	var ae *temporal.ApplicationError
	require.ErrorAs(t, env.GetWorkflowError(), &ae, "a claim timeout, not a heartbeat timeout")
	require.Equal(t, dedupactivity.ErrTypeClaimTimeout, ae.Type())
	require.Less(t, waited, heartbeat)
	require.GreaterOrEqual(t, waited, heartbeat*4/5-100*time.Millisecond)

	release()
	require.NoError(t, <-holder)
	require.Equal(t, int64(1), b.ledgerRows(t))
}
