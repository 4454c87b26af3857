package dedupactivity_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// requireOwnedRefusal: err is ErrTxOwned, reported as a non-retryable
// misuse, and nothing of the attempt committed.
func requireOwnedRefusal(t *testing.T, b *testBundle, err error) {
	t.Helper()
	require.ErrorIs(t, err, dedupactivity.ErrTxOwned)
	ae := appErr(t, err)
	require.Equal(t, dedupactivity.ErrTypeInvalidUsage, ae.Type())
	require.True(t, ae.NonRetryable())
	require.Zero(t, b.markers(t))
	require.Zero(t, b.ledgerRows(t))
}

// TestEffectCannotCommitOrRollBack: the Tx an effect gets refuses Commit and
// Rollback with ErrTxOwned; an effect that returns that error fails the
// attempt as a non-retryable misuse, and nothing commits.
func TestEffectCannotCommitOrRollBack(t *testing.T) {
	t.Parallel()
	for name, end := range map[string]func(context.Context, pgx.Tx) error{
		"Commit":   func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) },
		"Rollback": func(ctx context.Context, tx pgx.Tx) error { return tx.Rollback(ctx) },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				p, err := b.post(ctx, tx, in)
				if err != nil {
					return p, err
				}
				return p, end(ctx, tx)
			})
			_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
			requireOwnedRefusal(t, b, err)
		})
	}
}

// TestEffectCannotBeginATxInABatch: a Batch that begins a transaction of
// its own (Batch.BeginTx) is refused with ErrTxOwned, as pgx's own Tx
// refuses it, first call or not, through a savepoint too: its Tx could
// commit the claim transaction. Its BatchResults give a closed Tx, as
// pgx.FailedBatchResults does, so the usual deferred Rollback is safe, and
// committing it commits nothing.
func TestEffectCannotBeginATxInABatch(t *testing.T) {
	t.Parallel()
	for name, before := range map[string]func(context.Context, pgx.Tx, *testBundle) (pgx.Tx, error){
		"FirstCall": func(ctx context.Context, tx pgx.Tx, _ *testBundle) (pgx.Tx, error) { return tx, nil },
		"AfterStatement": func(ctx context.Context, tx pgx.Tx, b *testBundle) (pgx.Tx, error) {
			_, err := b.post(ctx, tx, Transfer{Account: "a", Amount: 1})
			return tx, err
		},
		"InSavepoint": func(ctx context.Context, tx pgx.Tx, b *testBundle) (pgx.Tx, error) {
			if _, err := b.post(ctx, tx, Transfer{Account: "a", Amount: 1}); err != nil {
				return nil, err
			}
			return tx.Begin(ctx)
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			var sendErr, commitErr error
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				tx, err := before(ctx, tx, b)
				if err != nil {
					return Posting{}, err
				}
				batch := &pgx.Batch{}
				batch.BeginTx(pgx.TxOptions{})
				batch.Queue(`INSERT INTO ledger (account, amount) VALUES ('b', 99)`)
				br := tx.SendBatch(ctx, batch)
				sendErr = br.Close()
				require.NotNil(t, br.Tx(), "a closed Tx, as pgx gives for a batch that begins one")
				commitErr = br.Tx().Commit(ctx)
				return Posting{}, sendErr
			})
			_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
			require.ErrorIs(t, sendErr, dedupactivity.ErrTxOwned)
			require.ErrorIs(t, commitErr, pgx.ErrTxClosed)
			requireOwnedRefusal(t, b, err)
		})
	}
}

// TestErrorsReadOnceInTheWorkflow: an error converted at the activity edge
// reads once, in the worker and in the workflow (the SDK's failure
// converter sends a cause per level of wrapping it can unwrap: each
// repeated the message), and still matches its sentinel in the worker.
func TestErrorsReadOnceInTheWorkflow(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		p, err := b.post(ctx, tx, in)
		if err != nil {
			return p, err
		}
		return p, tx.Commit(ctx)
	})
	const detail = "the effect called Tx.Commit"
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.ErrorIs(t, err, dedupactivity.ErrTxOwned)
	require.Equal(t, 1, strings.Count(err.Error(), detail), "%v", err)

	var s testsuite.WorkflowTestSuite
	env := s.NewTestWorkflowEnvironment()
	env.RegisterActivityWithOptions(fn, activity.RegisterOptions{Name: "Post"})
	env.ExecuteWorkflow(func(ctx workflow.Context, in Transfer) error {
		ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{StartToCloseTimeout: time.Minute})
		return workflow.ExecuteActivity(ctx, "Post", in).Get(ctx, nil)
	}, Transfer{Account: "a", Amount: 1})
	werr := env.GetWorkflowError()
	require.Error(t, werr)
	var ae *temporal.ApplicationError
	require.ErrorAs(t, werr, &ae)
	require.Equal(t, dedupactivity.ErrTypeInvalidUsage, ae.Type())
	require.Equal(t, 1, strings.Count(werr.Error(), detail), "%v", werr)
	var cause *temporal.ApplicationError
	require.ErrorAs(t, ae.Unwrap(), &cause, "one cause")
	require.Equal(t, "sentinel", cause.Type())
	require.Equal(t, dedupactivity.ErrTxOwned.Error(), cause.Message())
	require.Nil(t, cause.Unwrap(), "and no more")
	require.Zero(t, b.ledgerRows(t))
}

// TestEffectEndingTheTransactionWithSQL: an effect that ends the claim
// transaction with raw SQL (and may begin another and write in it) fails the
// attempt with ErrTxEnded; the marker is never written outside the attempt's
// own transaction, nothing the effect wrote after ending it commits, and no
// later delivery applies the effect a second time. With results stored or
// discarded.
func TestEffectEndingTheTransactionWithSQL(t *testing.T) {
	t.Parallel()
	type want struct {
		ledger, markers int64 // committed after the misusing attempt
		retryApplies    bool  // a later delivery applies the effect
	}
	cases := map[string]struct {
		sql  []string
		want want
	}{
		// Everything rolled back, the marker too: the event is not lost,
		// a retry applies it once.
		"Rollback": {sql: []string{"ROLLBACK"}, want: want{ledger: 0, markers: 0, retryApplies: true}},
		// A new transaction after the ROLLBACK, with a write: the claim's
		// check fails it, so that write does not commit either.
		"RollbackBeginWrite": {sql: []string{"ROLLBACK", "BEGIN", `INSERT INTO ledger (account, amount) VALUES ('b', 99)`}, want: want{ledger: 0, markers: 0, retryApplies: true}},
		// The marker committed with the effect's writes: the event is
		// marked, later deliveries apply nothing.
		"Commit": {sql: []string{"COMMIT"}, want: want{ledger: 1, markers: 1}},
		// COMMIT, then a new transaction with a write that does not commit.
		"CommitBeginWrite": {sql: []string{"COMMIT", "BEGIN", `INSERT INTO ledger (account, amount) VALUES ('b', 99)`}, want: want{ledger: 1, markers: 1}},
	}
	for name, c := range cases {
		for _, discard := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/DiscardResults=%v", name, discard), func(t *testing.T) {
				t.Parallel()
				b := setup(t, dedupactivity.Options{DiscardResults: discard})
				misuse := true
				fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
					p, err := b.post(ctx, tx, in)
					if err != nil || !misuse {
						return p, err
					}
					for _, sql := range c.sql {
						if _, err := tx.Exec(ctx, sql); err != nil {
							return p, err
						}
					}
					return p, nil
				})
				in := Transfer{Account: "a", Amount: 1}
				_, err := deliver(t, "Post", fn, in)
				require.ErrorIs(t, err, dedupactivity.ErrTxEnded)
				require.True(t, appErr(t, err).NonRetryable())
				if c.want.markers == 1 {
					require.ErrorContains(t, err, "it ran COMMIT", "the marker says what committed")
				} else {
					require.ErrorContains(t, err, "it ran ROLLBACK", "the marker says what committed")
				}
				require.Equal(t, c.want.ledger, b.ledgerRows(t))
				require.Equal(t, c.want.markers, b.markers(t))

				misuse = false
				_, err = deliver(t, "Post", fn, in)
				switch {
				case c.want.retryApplies:
					require.NoError(t, err)
					require.Equal(t, int64(1), b.ledgerRows(t), "the retry applied the effect once")
				case discard:
					require.NoError(t, err, "marked; results are not stored anyway")
					require.Equal(t, int64(1), b.ledgerRows(t), "no second application")
				default:
					require.ErrorIs(t, err, dedupactivity.ErrTxEnded, "the event is marked, its result unknown")
					require.Equal(t, int64(1), b.ledgerRows(t), "no second application")
				}
				require.Equal(t, int64(1), b.markers(t))
			})
		}
	}
}

// TestFailedStatementBeforeTheMarker: on a first attempt, whose claim went
// as a look, once a statement has failed a call without bind parameters is
// refused: all it could do is end the transaction (in any of these ways),
// and the marker would then go in with another one. Whatever the effect
// does with the refusal, nothing commits, and a later delivery applies the
// effect.
func TestFailedStatementBeforeTheMarker(t *testing.T) {
	t.Parallel()
	exec := func(sql string) func(context.Context, pgx.Tx) error {
		return func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, sql)
			return err
		}
	}
	ends := map[string]func(context.Context, pgx.Tx) error{
		"Rollback":           exec("ROLLBACK"),
		"Commit":             exec("COMMIT"),
		"RollbackAndChain":   exec("ROLLBACK AND CHAIN"),
		"CommitAndChain":     exec("COMMIT AND CHAIN"),
		"RollbackBeginWrite": exec(`ROLLBACK; BEGIN; INSERT INTO ledger (account, amount) VALUES ('b', 99)`),
		"Batch": func(ctx context.Context, tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue("ROLLBACK")
			b.Queue("BEGIN")
			return tx.SendBatch(ctx, b).Close()
		},
		"Conn": func(ctx context.Context, tx pgx.Tx) error {
			if c := tx.Conn(); c != nil {
				_, err := c.Exec(ctx, "ROLLBACK AND CHAIN")
				return err
			}
			return errors.New("transaction is aborted: no Conn")
		},
	}
	for name, end := range ends {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			misuse, swallow := true, true
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				p, err := b.post(ctx, tx, in)
				if err != nil || !misuse {
					return p, err
				}
				_, failed := tx.Exec(ctx, "SELECT 1/$1::int", 0)
				require.Error(t, failed)
				refused := end(ctx, tx)
				require.ErrorContains(t, refused, "transaction is aborted")
				if swallow {
					return p, nil
				}
				return p, errors.Join(failed, refused)
			})
			in := Transfer{Account: "a", Amount: 1}
			for _, swallow = range []bool{true, false} {
				_, err := deliver(t, "Post", fn, in)
				require.Error(t, err)
				f := temporal.GetDefaultFailureConverter().ErrorToFailure(err)
				require.False(t, f.GetApplicationFailureInfo().GetNonRetryable(), "retryable, as on any attempt (swallowed: %v)", swallow)
				require.Zero(t, b.ledgerRows(t))
				require.Zero(t, b.markers(t))
			}

			misuse = false
			_, err := deliver(t, "Post", fn, in)
			require.NoError(t, err)
			require.Equal(t, int64(1), b.ledgerRows(t), "a later delivery applied the effect once")
			require.Equal(t, int64(1), b.markers(t))
		})
	}
}

// TestCallWhileTheFirstRowsAreOpen: a call without bind parameters while
// Rows are open (the first statement's, which rode with the claim, or a
// later one's) fails alone, as pgx's busy connection does, and the attempt
// goes on once they are closed.
func TestCallWhileTheFirstRowsAreOpen(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		var p Posting
		rows, err := tx.Query(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2) RETURNING id`, in.Account, in.Amount)
		if err != nil {
			return p, err
		}
		require.Nil(t, rows.Conn())
		_, err = tx.Exec(ctx, "SELECT 1")
		require.ErrorContains(t, err, "conn busy")
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return p, err
		}
		p.EntryID = ids[0]
		// The same with a later Query's Rows.
		rows, err = tx.Query(ctx, `SELECT balance FROM account WHERE id = $1`, in.Account)
		if err != nil {
			return p, err
		}
		_, err = tx.Exec(ctx, "SELECT 1")
		require.ErrorContains(t, err, "conn busy")
		rows.Close()
		_, err = tx.Exec(ctx, "SELECT 1")
		return p, err
	})
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(1), b.markers(t))
}

// TestEarlyCommitWithConcurrentAttempt: an effect that commits the claim
// transaction early applies the effect once, with another attempt of the
// same event started after the COMMIT (it finds the marker) or before it,
// waiting on the key a business key's claim inserted first (the COMMIT
// commits the key, so the waiting insert finds it taken): the early COMMIT
// commits the marker too.
func TestEarlyCommitWithConcurrentAttempt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		opts []dedupactivity.WrapOption
		wait bool // the other attempt starts before the COMMIT and waits on the key
	}{
		{name: "AfterTheCommit"},
		{name: "WaitingOnTheKey", opts: []dedupactivity.WrapOption{dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return in.Account, nil })}, wait: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{ClaimWait: 10 * time.Second})
			claimed, committed := make(chan struct{}), make(chan struct{})
			var once sync.Once
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				p, err := b.post(ctx, tx, in)
				if err != nil {
					return p, err
				}
				first := false
				once.Do(func() { first = true })
				if !first {
					return p, nil
				}
				close(claimed)
				if tc.wait {
					// The other attempt's claim waits on this transaction's key.
					require.Eventually(t, func() bool {
						var waits bool
						err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted AND transactionid = pg_current_xact_id()::xid)`).Scan(&waits)
						return err == nil && waits
					}, 10*time.Second, 10*time.Millisecond)
				}
				if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
					return p, err
				}
				close(committed)
				time.Sleep(300 * time.Millisecond) // the other attempt runs now
				return p, nil
			}, tc.opts...)
			in := Transfer{Account: "a", Amount: 1}
			var wg sync.WaitGroup
			wg.Add(1)
			go func() { defer wg.Done(); _, _ = deliver(t, "Post", fn, in) }()
			if tc.wait {
				<-claimed
			} else {
				<-committed
			}
			_, err := deliver(t, "Post", fn, in)
			require.ErrorIs(t, err, dedupactivity.ErrTxEnded)
			wg.Wait()
			require.Equal(t, int64(1), b.ledgerRows(t), "applied once")
			require.Equal(t, int64(1), b.effects.Load(), "the other attempt did not run the effect")
		})
	}
}

// TestSavepointsWork: tx.Begin opens a savepoint; rolling it back undoes
// only its writes, committing it releases it.
func TestSavepointsWork(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		p, err := b.post(ctx, tx, in)
		if err != nil {
			return p, err
		}
		undone, err := tx.Begin(ctx)
		if err != nil {
			return p, err
		}
		if _, err := b.post(ctx, undone, Transfer{Account: "b", Amount: 100}); err != nil {
			return p, err
		}
		if err := undone.Rollback(ctx); err != nil {
			return p, err
		}
		kept, err := tx.Begin(ctx)
		if err != nil {
			return p, err
		}
		nested, err := kept.Begin(ctx)
		if err != nil {
			return p, err
		}
		if _, err := b.post(ctx, nested, Transfer{Account: "b", Amount: 5}); err != nil {
			return p, err
		}
		if err := nested.Commit(ctx); err != nil {
			return p, err
		}
		if err := kept.Commit(ctx); err != nil {
			return p, err
		}
		if err := kept.Commit(ctx); err == nil {
			t.Error("a released savepoint commits twice")
		}
		// A released savepoint's Rows carry the error, as pgx's do.
		rows, err := kept.Query(ctx, "SELECT 1")
		if !errors.Is(err, pgx.ErrTxClosed) || rows == nil || !errors.Is(rows.Err(), pgx.ErrTxClosed) {
			t.Errorf("Query on a released savepoint: rows %v, error %v", rows, err)
		}
		return p, nil
	})
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	require.Equal(t, int64(2), b.ledgerRows(t), "the outer write and the released savepoint's")
	require.Equal(t, int64(5), b.count(t, `SELECT balance FROM account WHERE id = 'b'`))
	require.Equal(t, int64(1), b.markers(t))
}

// TestSavepointEndsWithItsParent: a savepoint inside one the effect
// released or rolled back is gone too (PostgreSQL destroys it with its
// parent), so its calls return pgx.ErrTxClosed, as with pgx's own nested
// Tx, instead of writing in the claim's transaction outside both.
func TestSavepointEndsWithItsParent(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"Commit", "Rollback"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{}) // deliver's event is one per bundle
			var (
				runs     int
				innerErr error
			)
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				runs++
				p, err := b.post(ctx, tx, in)
				if err != nil {
					return p, err
				}
				outer, err := tx.Begin(ctx)
				if err != nil {
					return p, err
				}
				inner, err := outer.Begin(ctx)
				if err != nil {
					return p, err
				}
				if end == "Commit" {
					err = outer.Commit(ctx)
				} else {
					err = outer.Rollback(ctx)
				}
				if err != nil {
					return p, err
				}
				_, innerErr = b.post(ctx, inner, Transfer{Account: "b", Amount: 100})
				return p, nil
			})
			_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
			require.NoError(t, err)
			require.Equal(t, 1, runs)
			require.ErrorIs(t, innerErr, pgx.ErrTxClosed)
			require.Zero(t, b.count(t, `SELECT count(*) FROM ledger WHERE account = 'b'`), "the write on the ended savepoint")
		})
	}
}

// TestTxKeptByAGoroutine: a goroutine the effect started that uses the Tx
// after the attempt ended gets pgx.ErrTxClosed, without a data race with
// the claim, which sends its round trip after the Tx closed when the effect
// sent no statement (make test runs -race).
func TestTxKeptByAGoroutine(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	done := make(chan error, 1)
	_, _, err := dedupactivity.Do(ctx, b.d, runScoped("kept-by-goroutine"), Transfer{}, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
		go func() {
			time.Sleep(100 * time.Millisecond) // no synchronization with the attempt's end
			_, err := tx.Exec(context.Background(), `SELECT $1::int`, 1)
			done <- err
		}()
		return 1, nil // no statement: the claim is sent once the Tx is closed
	})
	require.NoError(t, err)
	require.ErrorIs(t, <-done, pgx.ErrTxClosed)
}

// TestTxCallInFlightWhenTheEffectReturns: a call a goroutine of the effect
// has in flight when the effect returns is waited for before the claim goes
// on with the connection (make test runs -race: without the wait, the
// claim's COMMIT raced with it), runs in the event's transaction, and the
// goroutine's next call gets pgx.ErrTxClosed.
func TestTxCallInFlightWhenTheEffectReturns(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	inFlight := make(chan struct{})
	first, next := make(chan error, 1), make(chan error, 1)
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		p, err := b.post(ctx, tx, in)
		if err != nil {
			return p, err
		}
		go func() {
			close(inFlight)
			_, err := tx.Exec(context.Background(), `INSERT INTO ledger (account, amount) SELECT 'b', $1::bigint FROM pg_sleep(0.5)`, 2)
			first <- err
			_, err = tx.Exec(context.Background(), `INSERT INTO ledger (account, amount) VALUES ('b', $1)`, 3)
			next <- err
		}()
		<-inFlight
		time.Sleep(100 * time.Millisecond) // the goroutine's statement is on the wire
		return p, nil
	})
	began := time.Now()
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	require.GreaterOrEqual(t, time.Since(began), 500*time.Millisecond, "the claim waited for the call in flight")
	require.NoError(t, <-first)
	require.ErrorIs(t, <-next, pgx.ErrTxClosed)
	require.Equal(t, int64(2), b.ledgerRows(t), "the effect's row and the call in flight's, in the event's transaction")
	require.Equal(t, int64(1), b.markers(t))
}

// TestTxConnWhileACallIsInFlight: Conn called while another goroutine's
// call on the Tx is in flight gives the connection a call gave before, or
// nil, and does not touch the claim (make test runs -race: Conn ran the
// claim's state machine, and sent the claim a second time, on the busy
// connection).
func TestTxConnWhileACallIsInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	var calls int
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		done := make(chan error, 1)
		go func() {
			for {
				// Refused while a Conn below holds the Tx: tried again.
				_, err := tx.Exec(ctx, `SELECT pg_sleep(0.3)`)
				if err == nil || !strings.Contains(err.Error(), "conn busy") {
					done <- err
					return
				}
			}
		}()
		time.Sleep(50 * time.Millisecond) // the Exec goes first: it sends the claim
		for {
			select {
			case err := <-done:
				if err != nil {
					return Posting{}, err
				}
				return b.post(ctx, tx, in)
			default:
				_ = tx.Conn()
				calls++
			}
		}
	})
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	require.Positive(t, calls)
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(1), b.markers(t))
}

// TestTxInABatchCallback: inside a Batch's callback, while the batch holds
// the Tx, a call on it gets "conn busy", Conn gives the connection the
// SendBatch kept, and LargeObjects gives large objects whose calls return
// pgx.ErrTxClosed (asking the claim's Tx for them there sent a statement on
// the busy connection, and the attempt failed).
func TestTxInABatchCallback(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	var execErr, loErr error
	var conn *pgx.Conn
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		batch := &pgx.Batch{}
		batch.Queue(`SELECT 1`).Exec(func(pgconn.CommandTag) error {
			_, execErr = tx.Exec(ctx, `SELECT 2`)
			conn = tx.Conn()
			lo := tx.LargeObjects()
			_, loErr = lo.Create(ctx, 0)
			return nil
		})
		if err := tx.SendBatch(ctx, batch).Close(); err != nil {
			return Posting{}, err
		}
		return b.post(ctx, tx, in)
	})
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	require.ErrorContains(t, execErr, "conn busy")
	require.NotNil(t, conn)
	require.ErrorIs(t, loErr, pgx.ErrTxClosed)
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(1), b.markers(t))
}

// TestTxRowsCutByABusyCall: a Next refused because another goroutine's call
// on the Tx was in flight ends the Rows with an error, never as if they
// were all read: an effect that stores how many rows it read commits the
// full count or fails. The goroutine has stopped by the time the effect
// reads Err, so only a refusal kept by the Rows can report it; and their
// Close then closes them, so the Tx takes statements again.
func TestTxRowsCutByABusyCall(t *testing.T) {
	t.Parallel()
	const total = 200000
	b := setup(t, dedupactivity.Options{})
	var read int64
	var rowsErr, afterClose error
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		rows, err := tx.Query(ctx, `SELECT g FROM generate_series(1, $1::int) g`, total)
		if err != nil {
			return Posting{}, err
		}
		stop, stopped := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(stopped)
			for {
				select {
				case <-stop:
					return
				default:
					_, _ = tx.Exec(ctx, `SELECT 1`) // busy either way; it holds the Tx a moment
				}
			}
		}()
		for rows.Next() {
			read++
		}
		close(stop)
		<-stopped
		rowsErr = rows.Err()
		rows.Close()
		_, afterClose = tx.Exec(ctx, `SELECT $1::int`, 1)
		if rowsErr != nil {
			return Posting{}, rowsErr
		}
		return b.post(ctx, tx, Transfer{Account: "a", Amount: read})
	})
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	t.Logf("read %d of %d rows; Err: %v", read, total, rowsErr)
	if read < total {
		require.ErrorContains(t, rowsErr, "conn busy", "the Rows were cut short: their Err says so")
		require.Error(t, err)
	}
	require.NoError(t, afterClose, "Close closed the rows")
	require.Zero(t, b.count(t, `SELECT count(*) FROM ledger WHERE amount <> $1`, total), "no short count committed")
}

// TestTxDiesWithTheAttempt: a Tx (or savepoint) kept past the attempt
// returns pgx.ErrTxClosed from every method and writes nothing (inside
// another event's transaction on its connection: TestKeptTxCannotWriteIntoAnotherEvent).
func TestTxDiesWithTheAttempt(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	var kept, keptSavepoint pgx.Tx
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		kept = tx
		sp, err := tx.Begin(ctx)
		if err != nil {
			return Posting{}, err
		}
		keptSavepoint = sp
		return b.post(ctx, tx, in)
	})
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)

	ctx := context.Background()
	for _, tx := range []pgx.Tx{kept, keptSavepoint} {
		_, err = tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ('a', 1)`)
		require.ErrorIs(t, err, pgx.ErrTxClosed)
		_, err = tx.Query(ctx, `SELECT 1`)
		require.ErrorIs(t, err, pgx.ErrTxClosed)
		require.ErrorIs(t, tx.QueryRow(ctx, `SELECT 1`).Scan(new(int)), pgx.ErrTxClosed)
		br := tx.SendBatch(ctx, &pgx.Batch{})
		_, err = br.Exec()
		require.ErrorIs(t, err, pgx.ErrTxClosed)
		_, err = tx.Begin(ctx)
		require.ErrorIs(t, err, pgx.ErrTxClosed)
		_, err = tx.CopyFrom(ctx, pgx.Identifier{"ledger"}, []string{"account", "amount"}, pgx.CopyFromRows([][]any{{"a", 1}}))
		require.ErrorIs(t, err, pgx.ErrTxClosed)
		_, err = tx.Prepare(ctx, "s", `SELECT 1`)
		require.ErrorIs(t, err, pgx.ErrTxClosed)
		require.ErrorIs(t, tx.Commit(ctx), pgx.ErrTxClosed)
		require.ErrorIs(t, tx.Rollback(ctx), pgx.ErrTxClosed)
		require.Nil(t, tx.Conn())
	}
	require.Equal(t, int64(1), b.ledgerRows(t))
}

// TestSwallowedStatementErrorFailsTheAttempt: an effect whose statement
// failed but which returns no error fails the attempt, and nothing commits,
// whether the claim went first (a business key) or rode with the first
// statement; a later delivery applies the effect once.
func TestSwallowedStatementErrorFailsTheAttempt(t *testing.T) {
	t.Parallel()
	for name, opts := range map[string][]dedupactivity.WrapOption{
		"ClaimFirst": {dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return in.Account, nil })},
		"Riding":     nil,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			swallow := true
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				p, err := b.post(ctx, tx, in)
				if err != nil || !swallow {
					return p, err
				}
				_, failed := tx.Exec(ctx, "SELECT 1/$1::int", 0)
				require.Error(t, failed)
				return p, nil // the error swallowed
			}, opts...)
			in := Transfer{Account: "a", Amount: 1}
			_, err := deliver(t, "Post", fn, in)
			require.ErrorContains(t, err, "returned no error")
			require.Zero(t, b.ledgerRows(t))
			require.Zero(t, b.markers(t))

			swallow = false
			_, err = deliver(t, "Post", fn, in)
			require.NoError(t, err)
			require.Equal(t, int64(1), b.ledgerRows(t), "a later delivery applied the effect once")
			require.Equal(t, int64(1), b.markers(t))
		})
	}
}

// TestSwallowedFailureAfterTheEffectsCommit: an effect that ran COMMIT (and
// BEGIN), then a statement that failed, and returned no error committed the
// marker with its writes before the COMMIT: the attempt says so with
// ErrTxEnded (non-retryable), as after COMMIT alone, not that all was rolled
// back. After ROLLBACK and BEGIN nothing committed, and it says that.
func TestSwallowedFailureAfterTheEffectsCommit(t *testing.T) {
	t.Parallel()
	for name, end := range map[string]string{"Commit": "COMMIT", "Rollback": "ROLLBACK"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				p, err := b.post(ctx, tx, in)
				if err != nil {
					return p, err
				}
				for _, sql := range []string{end, "BEGIN"} {
					if _, err := tx.Exec(ctx, sql); err != nil {
						return p, err
					}
				}
				_, failed := tx.Exec(ctx, "SELECT 1/$1::int", 0)
				require.Error(t, failed)
				return p, nil // the error swallowed
			})
			_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
			if end == "COMMIT" {
				require.ErrorIs(t, err, dedupactivity.ErrTxEnded)
				require.ErrorContains(t, err, "it ran COMMIT")
				require.True(t, appErr(t, err).NonRetryable())
				require.Equal(t, int64(1), b.ledgerRows(t), "the writes before the COMMIT committed")
				require.Equal(t, int64(1), b.markers(t))
				return
			}
			require.ErrorContains(t, err, "all was rolled back")
			require.Zero(t, b.ledgerRows(t))
			require.Zero(t, b.markers(t))
		})
	}
}

// TestKeptTxCannotWriteIntoAnotherEvent: a Tx kept past its attempt, used
// while its pooled connection (the pool's only one) carries another event's
// transaction, returns pgx.ErrTxClosed and writes nothing into it.
func TestKeptTxCannotWriteIntoAnotherEvent(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(b.schema.URL)
	require.NoError(t, err)
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)

	var kept pgx.Tx
	_, _, err = dedupactivity.Do(ctx, d, runScoped("first"), Transfer{Account: "a", Amount: 1}, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		kept = tx
		return b.post(ctx, tx, in)
	})
	require.NoError(t, err)
	_, _, err = dedupactivity.Do(ctx, d, runScoped("second"), Transfer{Account: "a", Amount: 2}, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		p, err := b.post(ctx, tx, in)
		if err != nil {
			return p, err
		}
		_, keptErr := kept.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2)`, "b", 99)
		require.ErrorIs(t, keptErr, pgx.ErrTxClosed)
		_, keptErr = kept.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ('b', 99)`)
		require.ErrorIs(t, keptErr, pgx.ErrTxClosed)
		return p, nil
	})
	require.NoError(t, err)
	require.Equal(t, int64(2), b.ledgerRows(t), "the two events' own writes only")
	require.Zero(t, b.count(t, `SELECT count(*) FROM ledger WHERE account = 'b'`))
}

// TestEffectDeletingItsMarker: an effect of a claim that went first (a
// business key) that deletes the marker row its claim inserted fails the
// attempt with ErrTxEnded, as the result update finds no row: the attempt
// is not reported as claimed while the event is left unmarked.
func TestEffectDeletingItsMarker(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "order-del"}
	_, outcome, err := dedupactivity.Do(context.Background(), b.d, id, Transfer{Account: "a", Amount: 2},
		func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
			p, err := b.post(ctx, tx, in)
			if err != nil {
				return p, err
			}
			_, err = tx.Exec(ctx, `DELETE FROM dedup_marker WHERE id_hash = $1`, hashOf(id))
			return p, err
		})
	require.ErrorIs(t, err, dedupactivity.ErrTxEnded)
	require.ErrorContains(t, err, "changed the marker row")
	require.NotEqual(t, dedupactivity.OutcomeClaimed, outcome)
	require.Zero(t, b.markers(t), "the effect deleted the marker")
}
