package dedupactivity_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"
	"google.golang.org/protobuf/proto"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

func appErr(t *testing.T, err error) *temporal.ApplicationError {
	t.Helper()
	var ae *temporal.ApplicationError
	require.ErrorAs(t, err, &ae, "want an ApplicationError, got %v", err)
	return ae
}

func TestDuplicateReturnsStoredResult(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	fn := dedupactivity.Wrap(b.d, b.post)
	in := Transfer{Account: "a", Amount: 10}

	first, err := deliver(t, "Post", fn, in)
	require.NoError(t, err)
	require.Equal(t, int64(10), first.Balance)

	second, err := deliver(t, "Post", fn, in)
	require.NoError(t, err)
	require.Equal(t, first, second, "a duplicate returns the first attempt's result")
	require.Equal(t, int64(1), b.effects.Load(), "the effect ran once")
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(1), b.markers(t))
}

// TestAnotherActivityTypeIsNotADuplicate: a delivery of another activity
// type under the same run-scoped identity (two activities with one workflow
// run and activity ID: every test environment has the same IDs), regular or
// local, is not given the first's stored result, of another type: it fails
// with ErrPayloadMismatch, whatever the mismatch policy, and applies
// nothing.
func TestAnotherActivityTypeIsNotADuplicate(t *testing.T) {
	t.Parallel()
	for _, policy := range []dedupactivity.MismatchPolicy{dedupactivity.MismatchReject, dedupactivity.MismatchReturnStored} {
		t.Run(policy.String(), func(t *testing.T) {
			b := setup(t, dedupactivity.Options{MismatchPolicy: policy})
			fn := dedupactivity.Wrap(b.d, b.post)
			in := Transfer{Account: "a", Amount: 10}
			_, err := deliver(t, "Post", fn, in)
			require.NoError(t, err)

			_, err = deliver(t, "Refund", fn, in)
			require.ErrorIs(t, err, dedupactivity.ErrPayloadMismatch)
			require.ErrorContains(t, err, `applied by activity type "Post"`)
			require.ErrorContains(t, err, `this delivery is of "Refund"`)
			require.True(t, appErr(t, err).NonRetryable())
			require.Equal(t, int64(1), b.ledgerRows(t))
			require.Equal(t, int64(1), b.markers(t))

			_, err = deliver(t, "Post", fn, in)
			require.NoError(t, err, "the same type is a duplicate")
		})
	}

	// Local activities too: two of them in test environments share their
	// IDs (and the SDK fails one whose type changed at its ID).
	b := setup(t, dedupactivity.Options{})
	in := Transfer{Account: "a", Amount: 10}
	local := func(name string) error {
		var s testsuite.WorkflowTestSuite
		env := s.NewTestActivityEnvironment()
		fn := dedupactivity.Wrap(b.d, b.post)
		env.RegisterActivityWithOptions(fn, activity.RegisterOptions{Name: name})
		_, err := env.ExecuteLocalActivity(fn, in)
		return err
	}
	require.NoError(t, local("PostLocal"))
	err := local("RefundLocal")
	require.ErrorContains(t, err, dedupactivity.ErrTypePayloadMismatch)
	require.ErrorContains(t, err, `applied by activity type "PostLocal"`)
	require.Equal(t, int64(1), b.ledgerRows(t))
}

// TestOneActivityEnvironmentDeliversNewEvents: ExecuteActivity twice in one
// test environment delivers two events (the environment gives each call a
// new activity ID), as the README's testing section says; a new
// environment delivers the first again (see deliver).
func TestOneActivityEnvironmentDeliversNewEvents(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	var s testsuite.WorkflowTestSuite
	env := s.NewTestActivityEnvironment()
	env.RegisterActivityWithOptions(dedupactivity.Wrap(b.d, b.post), activity.RegisterOptions{Name: "Post"})
	for range 2 {
		_, err := env.ExecuteActivity("Post", Transfer{Account: "a", Amount: 1})
		require.NoError(t, err)
	}
	require.Equal(t, int64(2), b.ledgerRows(t))
	require.Equal(t, int64(2), b.markers(t))
}

func TestMarkerAndEffectInOneTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	var txPID, claimPID uint32
	dedupactivity.SetAfterClaimHook(b.d, func(ctx context.Context, tx pgx.Tx) error {
		claimPID = tx.Conn().PgConn().PID()
		// The claim inserted the marker in this transaction, without a
		// result yet; nothing is committed.
		var mine, committed int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM dedup_marker WHERE result IS NULL`).Scan(&mine); err != nil {
			return err
		}
		if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM dedup_marker`).Scan(&committed); err != nil {
			return err
		}
		if mine != 1 || committed != 0 {
			return fmt.Errorf("after the claim: %d markers in the claim transaction, %d committed", mine, committed)
		}
		return nil
	})
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		txPID = tx.Conn().PgConn().PID()
		return b.post(ctx, tx, in)
	})
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	require.Equal(t, claimPID, txPID, "effect runs on the claim's connection")
	var same bool
	require.NoError(t, b.pool.QueryRow(context.Background(),
		`SELECT m.xmin::text = l.xmin::text FROM dedup_marker m, ledger l`).Scan(&same))
	require.True(t, same, "the marker and the effect were written by one transaction")
}

// TestConcurrentDeliveries: deliveries of one event at once apply it once
// and all return the committed result. With a business key the claim goes
// first, so the others wait on it and never run the effect; a run-scoped
// first attempt's claim goes with COMMIT, so they all run the effect and
// all but one roll back.
func TestConcurrentDeliveries(t *testing.T) {
	t.Parallel()
	for name, opts := range map[string][]dedupactivity.WrapOption{
		"BusinessKey": {dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return in.Account, nil })},
		"RunScoped":   nil,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{ClaimWait: 20 * time.Second})
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				p, err := b.post(ctx, tx, in)
				time.Sleep(200 * time.Millisecond) // hold the claim while others arrive
				return p, err
			}, opts...)
			const n = 32
			var (
				wg      sync.WaitGroup
				mu      sync.Mutex
				results []Posting
				errs    []error
			)
			start := make(chan struct{})
			for range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					p, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 5})
					mu.Lock()
					defer mu.Unlock()
					if err != nil {
						errs = append(errs, err)
						return
					}
					results = append(results, p)
				}()
			}
			close(start)
			wg.Wait()

			require.Empty(t, errs)
			require.Len(t, results, n)
			for _, r := range results {
				require.Equal(t, results[0], r, "every successful attempt returns the committed result")
			}
			if name == "BusinessKey" {
				require.Equal(t, int64(1), b.effects.Load(), "the others waited on the claim")
			}
			require.Equal(t, int64(1), b.ledgerRows(t))
			require.Equal(t, int64(5), b.count(t, `SELECT balance FROM account WHERE id = 'a'`))
		})
	}
}

func TestClaimWaitIsBounded(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{ClaimWait: 300 * time.Millisecond})
	holding, release := holdFirstClaim(t, b)
	fn := dedupactivity.Wrap(b.d, b.post)
	in := Transfer{Account: "a", Amount: 3}

	holderDone := make(chan error, 1)
	go func() { _, err := deliver(t, "Post", fn, in); holderDone <- err }()
	<-holding

	began := time.Now()
	_, err := deliver(t, "Post", fn, in)
	waited := time.Since(began)
	require.ErrorIs(t, err, dedupactivity.ErrClaimTimeout)
	ae := appErr(t, err)
	require.Equal(t, dedupactivity.ErrTypeClaimTimeout, ae.Type())
	require.False(t, ae.NonRetryable(), "a claim timeout is retryable")
	require.Equal(t, "55P03", sqlStateOf(err), "errors.As reaches the PostgreSQL error after the conversion")
	require.Less(t, waited, 10*time.Second)

	release()
	require.NoError(t, <-holderDone)
	p, err := deliver(t, "Post", fn, in)
	require.NoError(t, err, "the retry after the holder committed is a duplicate")
	require.Equal(t, int64(3), p.Balance)
	require.Equal(t, int64(1), b.effects.Load())
}

// TestFaultBetweenClaimAndEffect injects failures after the marker insert and
// before the effect: everything rolls back and the next attempt applies the
// effect once.
func TestFaultBetweenClaimAndEffect(t *testing.T) {
	t.Parallel()
	faults := map[string]func(b *testBundle, cancel context.CancelFunc) func(ctx context.Context, tx pgx.Tx) error{
		"HookError": func(*testBundle, context.CancelFunc) func(context.Context, pgx.Tx) error {
			return func(context.Context, pgx.Tx) error { return errors.New("injected") }
		},
		"Panic": func(*testBundle, context.CancelFunc) func(context.Context, pgx.Tx) error {
			return func(context.Context, pgx.Tx) error { panic("injected panic") }
		},
		"ContextCancelled": func(_ *testBundle, cancel context.CancelFunc) func(context.Context, pgx.Tx) error {
			return func(context.Context, pgx.Tx) error { cancel(); return nil }
		},
		"BackendTerminated": func(b *testBundle, _ context.CancelFunc) func(context.Context, pgx.Tx) error {
			return func(ctx context.Context, tx pgx.Tx) error {
				_, err := b.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, tx.Conn().PgConn().PID())
				return err
			}
		},
	}
	for name, fault := range faults {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			wrapped := dedupactivity.Wrap(b.d, b.post)
			var cancel context.CancelFunc
			// The driver calls the wrapped activity with a context the fault
			// can cancel; it keeps the activity's values.
			driver := func(ctx context.Context, in Transfer) (Posting, error) {
				ctx, cancel = context.WithCancel(ctx)
				defer cancel()
				return wrapped(ctx, in)
			}
			var once sync.Once
			dedupactivity.SetAfterClaimHook(b.d, func(ctx context.Context, tx pgx.Tx) (err error) {
				once.Do(func() { err = fault(b, cancel)(ctx, tx) })
				return err
			})
			in := Transfer{Account: "b", Amount: 7}
			_, err := deliver(t, "Post", driver, in)
			require.Error(t, err, "the faulted attempt fails")
			require.Zero(t, b.markers(t), "no marker remains")
			require.Zero(t, b.ledgerRows(t))
			ranBefore := b.effects.Load() // the effect body may have started on a dead transaction

			p, err := deliver(t, "Post", driver, in)
			require.NoError(t, err, "the retry claims the event")
			require.Equal(t, int64(7), p.Balance)
			_, err = deliver(t, "Post", driver, in)
			require.NoError(t, err)
			require.Equal(t, int64(1), b.effects.Load()-ranBefore, "the retries applied the effect once")
			require.Equal(t, int64(1), b.ledgerRows(t))
			require.Equal(t, int64(1), b.markers(t))
		})
	}
}

func TestLostCompletion(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	wrapped := dedupactivity.Wrap(b.d, b.post)
	lose := true
	// The first attempt commits its effect, then fails before reporting.
	driver := func(ctx context.Context, in Transfer) (Posting, error) {
		p, err := wrapped(ctx, in)
		if lose {
			lose = false
			return Posting{}, errors.New("worker lost before completion")
		}
		return p, err
	}
	in := Transfer{Account: "a", Amount: 11}
	_, err := deliver(t, "Post", driver, in)
	require.Error(t, err)
	require.Equal(t, int64(1), b.ledgerRows(t), "the effect committed")

	p, err := deliver(t, "Post", driver, in)
	require.NoError(t, err)
	require.Equal(t, Posting{EntryID: 1, Balance: 11}, p, "the retry returns the stored result")
	require.Equal(t, int64(1), b.effects.Load())
}

// TestLostCompletionInTheWorkflowEnvironment: in the SDK's workflow test
// environment a retry is attempt 2, which claims before the effect runs, as
// after a real lost completion; in the activity test environment every
// delivery is attempt 1, whose claim rides with the effect's first
// statement (TestDuplicateWhoseClaimRode). The README's testing section
// points here. The retry does not call the effect at all.
func TestLostCompletionInTheWorkflowEnvironment(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	var calls atomic.Int64
	wrapped := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		calls.Add(1)
		return b.post(ctx, tx, in)
	})
	var attempts []int32
	driver := func(ctx context.Context, in Transfer) (Posting, error) {
		attempt := activity.GetInfo(ctx).Attempt
		attempts = append(attempts, attempt)
		p, err := wrapped(ctx, in)
		if attempt == 1 {
			return Posting{}, errors.New("worker lost before completion") // the effect committed
		}
		return p, err
	}
	p, err := runPost(t, driver, "", Transfer{Account: "a", Amount: 5})
	require.NoError(t, err)
	require.Equal(t, []int32{1, 2}, attempts)
	require.Equal(t, Posting{EntryID: 1, Balance: 5}, p, "the retry returns the stored result")
	require.Equal(t, int64(1), calls.Load(), "the retry claimed first: the effect was called once")
	require.Equal(t, int64(1), b.ledgerRows(t))
}

func TestPayloadMismatch(t *testing.T) {
	t.Parallel()
	key := dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return "order-" + in.Account, nil })
	t.Run("RejectByDefault", func(t *testing.T) {
		t.Parallel()
		b := setup(t, dedupactivity.Options{})
		fn := dedupactivity.Wrap(b.d, b.post, key)
		_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
		require.NoError(t, err)

		_, err = deliver(t, "Post", fn, Transfer{Account: "a", Amount: 2})
		require.ErrorIs(t, err, dedupactivity.ErrPayloadMismatch)
		ae := appErr(t, err)
		require.Equal(t, dedupactivity.ErrTypePayloadMismatch, ae.Type())
		require.True(t, ae.NonRetryable())
		require.Equal(t, int64(1), b.count(t, `SELECT balance FROM account WHERE id = 'a'`), "stored effect untouched")
		require.Equal(t, int64(1), b.effects.Load())
	})
	t.Run("ReturnStored", func(t *testing.T) {
		t.Parallel()
		b := setup(t, dedupactivity.Options{MismatchPolicy: dedupactivity.MismatchReturnStored})
		fn := dedupactivity.Wrap(b.d, b.post, key)
		first, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
		require.NoError(t, err)
		second, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 2})
		require.NoError(t, err)
		require.Equal(t, first, second)
		require.Equal(t, int64(1), b.effects.Load())
	})
}

func TestEffectErrorRollsBack(t *testing.T) {
	t.Parallel()
	cases := map[string]error{
		"Retryable":    errors.New("plain failure"),
		"NonRetryable": temporal.NewNonRetryableApplicationError("bad transfer", "BadTransfer", nil),
	}
	for name, effectErr := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				if _, err := b.post(ctx, tx, in); err != nil {
					return Posting{}, err
				}
				return Posting{}, effectErr // after writing: the writes must roll back
			})
			_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 4})
			require.Equal(t, effectErr, err, "the effect's error reaches Temporal unchanged")
			require.Zero(t, b.markers(t))
			require.Zero(t, b.ledgerRows(t))
			require.Zero(t, b.count(t, `SELECT balance FROM account WHERE id = 'a'`))
		})
	}
}

// TestFailedAttemptKeepsItsConnection: an attempt that fails or panics in
// its effect rolls its transaction back before it returns the connection to
// the pool, which keeps it (pgxpool destroys a connection released in a
// transaction, and the next attempt would pay for a new connection and the
// claim's prepares). One connection: the backend is the same after.
func TestFailedAttemptKeepsItsConnection(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	d, pool, _ := countingDeduper(t, b, nil)
	ctx := context.Background()
	pid := func() (p int32) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&p))
		return p
	}
	before := pid()
	errOwn := errors.New("after writing")
	for i, id := range []dedupactivity.Identity{runScoped("keeps"), {Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "keeps"}} {
		_, outcome, err := dedupactivity.Do(ctx, d, id, Transfer{Account: "a", Amount: 1},
			func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				p, err := b.post(ctx, tx, in)
				if err != nil {
					return p, err
				}
				return p, errOwn
			})
		require.ErrorIs(t, err, errOwn)
		require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
		require.Equal(t, before, pid(), "identity %d: the connection was kept", i)
		require.Panics(t, func() {
			_, _, _ = dedupactivity.Do(ctx, d, id, Transfer{Account: "a", Amount: 1},
				func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
					if _, err := b.post(ctx, tx, in); err != nil {
						return Posting{}, err
					}
					panic("effect panics after writing")
				})
		})
		require.Equal(t, before, pid(), "identity %d: the connection was kept after a panic", i)
	}
	require.Zero(t, b.ledgerRows(t))
	require.Zero(t, b.markers(t))
}

func TestBusinessKey(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	key := dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return "order-" + in.Account, nil })
	fn := dedupactivity.Wrap(b.d, b.post, key)

	// Two different workflow runs deliver the same business event.
	p1, err := runPost(t, fn, "wf-1", Transfer{Account: "a", Amount: 9})
	require.NoError(t, err)
	p2, err := runPost(t, fn, "wf-2", Transfer{Account: "a", Amount: 9})
	require.NoError(t, err)
	require.Equal(t, p1, p2)
	require.Equal(t, int64(1), b.effects.Load())

	// The same key under another activity type is another event.
	_, err = deliver(t, "PostAgain", fn, Transfer{Account: "a", Amount: 9})
	require.NoError(t, err)
	require.Equal(t, int64(2), b.effects.Load())

	// An empty key is refused before anything is written.
	empty := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(Transfer) (string, error) { return "", nil }))
	_, err = deliver(t, "Empty", empty, Transfer{Account: "b", Amount: 1})
	require.ErrorIs(t, err, dedupactivity.ErrEmptyBusinessKey)
	require.True(t, appErr(t, err).NonRetryable())
	require.Equal(t, int64(2), b.markers(t))

	// A key function for another input type is refused when wrapping.
	require.PanicsWithValue(t, "dedupactivity: Wrap: dedupactivity: invalid options: WithBusinessKey takes string, the activity's input is dedupactivity_test.Transfer", func() {
		dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(string) (string, error) { return "k", nil }))
	})
}

func TestStoredResultsUseDataConverter(t *testing.T) {
	t.Parallel()
	dc := newXORConverter()
	b := setup(t, dedupactivity.Options{DataConverter: dc})
	fn := dedupactivity.Wrap(b.d, b.post)
	first, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 12})
	require.NoError(t, err)

	var raw []byte
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT result FROM dedup_marker`).Scan(&raw))
	require.Contains(t, string(raw), xorEncoding, "the codec's encoding is stored")
	require.NotContains(t, string(raw), `"Balance"`, "the plain JSON is not stored")

	second, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 12})
	require.NoError(t, err)
	require.Equal(t, first, second)
}

func TestDiscardResults(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{DiscardResults: true})
	fn := dedupactivity.Wrap(b.d, b.post)
	first, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 2})
	require.NoError(t, err)
	require.Equal(t, int64(2), first.Balance)
	second, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 2})
	require.NoError(t, err)
	require.Zero(t, second, "a duplicate returns the zero value when results are not stored")
	require.Zero(t, b.count(t, `SELECT count(*) FROM dedup_marker WHERE octet_length(result) > 0`))
}

func TestResultTooLarge(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{MaxResultBytes: 64})
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (string, error) {
		if _, err := b.post(ctx, tx, in); err != nil {
			return "", err
		}
		return string(make([]byte, 100)), nil
	})
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.ErrorIs(t, err, dedupactivity.ErrResultTooLarge)
	ae := appErr(t, err)
	require.Equal(t, dedupactivity.ErrTypeResultTooLarge, ae.Type())
	require.True(t, ae.NonRetryable())
	require.Zero(t, b.markers(t))
	require.Zero(t, b.ledgerRows(t))
}

// TestResultTooLargeForTemporal: MaxResultBytes bounds the result as
// Temporal measures it against its payload size limit: the Payloads an
// activity completes with (the SDK's payload limit check and the server's
// blob size limit measure that), a few bytes more than the one Payload. A
// result within MaxResultBytes as a Payload but over it as Temporal sends
// it is refused before anything commits: stored, its effect would commit
// and every delivery's completion would be refused, the duplicates' too.
func TestResultTooLargeForTemporal(t *testing.T) {
	t.Parallel()
	const limit = 200
	b := setup(t, dedupactivity.Options{MaxResultBytes: limit})
	// A string whose Payload, as the default converter makes it, is limit
	// bytes.
	result := ""
	for n := 1; ; n++ {
		p, err := converter.GetDefaultDataConverter().ToPayload(strings.Repeat("x", n))
		require.NoError(t, err)
		if proto.Size(p) == limit {
			result = strings.Repeat("x", n)
			require.Greater(t, (&commonpb.Payloads{Payloads: []*commonpb.Payload{p}}).Size(), limit, "as Temporal measures it, it is over the limit")
			break
		}
		require.Less(t, proto.Size(p), limit)
	}
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (string, error) {
		if _, err := b.post(ctx, tx, in); err != nil {
			return "", err
		}
		return result, nil
	})
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.ErrorIs(t, err, dedupactivity.ErrResultTooLarge)
	require.Zero(t, b.markers(t))
	require.Zero(t, b.ledgerRows(t))
}

func TestDoOutsideTemporal(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "kafka", ActivityType: "Post", Key: "offset-42"}
	in := Transfer{Account: "a", Amount: 6}

	p1, outcome, err := dedupactivity.Do(ctx, b.d, id, in, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	p2, outcome, err := dedupactivity.Do(ctx, b.d, id, in, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, p1, p2)

	_, outcome, err = dedupactivity.Do(ctx, b.d, id, Transfer{Account: "a", Amount: 7}, b.post)
	require.ErrorIs(t, err, dedupactivity.ErrPayloadMismatch)
	var ae *temporal.ApplicationError
	require.False(t, errors.As(err, &ae), "Do leaves errors unconverted")
	require.Equal(t, dedupactivity.OutcomePayloadMismatch, outcome)
	require.Equal(t, int64(1), b.effects.Load())

	_, _, err = dedupactivity.Do(ctx, b.d, dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey}, in, b.post)
	require.ErrorIs(t, err, dedupactivity.ErrEmptyBusinessKey)
}

// TestClaimWaitCutByDeadline: the wait for a holder ends before the caller's
// deadline, as a claim timeout (retryable), not as a cancelled query.
func TestClaimWaitCutByDeadline(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{}) // ClaimWait: the 10s default
	id, in, releaseHeld := heldEvent(t, b)

	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	defer cancel()
	_, outcome, err := dedupactivity.Do(ctx, b.d, id, in, b.post)
	// A claim timeout before the 10s ClaimWait: the deadline cut it short.
	require.ErrorIs(t, err, dedupactivity.ErrClaimTimeout)
	require.Equal(t, dedupactivity.OutcomeClaimTimeout, outcome)
	// Ended by the claim's own lock_timeout, cut to the deadline less a
	// margin, not by the deadline cancelling the query (57014) or the
	// connection (a context error).
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr, "ended by the claim's lock_timeout: %v", err)
	require.Equal(t, "55P03", pgErr.Code, "lock_not_available, not a cancelled query: %v", err)

	releaseHeld()
}

// TestClaimWaitCancelled: a claim waiting for a holder whose caller's
// context is cancelled fails with the context's error, not as a claim
// timeout, also when pgx stops the query with a cancel request
// (CancelRequestContextWatcherHandler), whose SQLSTATE (57014) is
// statement_timeout's too; its span's error.type is context.Canceled.
func TestClaimWaitCancelled(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	id, in, releaseHeld := heldEvent(t, b)

	for name, handler := range map[string]func(*pgconn.PgConn) ctxwatch.Handler{
		"Deadline": nil, // pgx's default
		"CancelRequest": func(c *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: c, CancelRequestDelay: 0, DeadlineDelay: time.Second}
		},
	} {
		app := "claim-wait-cancelled-" + b.schema.Name + "-" + name
		pool := b.newPool(t, func(cfg *pgxpool.Config) {
			cfg.ConnConfig.RuntimeParams["application_name"] = app
			if handler != nil {
				cfg.ConnConfig.BuildContextWatcherHandler = handler
			}
		})
		spans := tracetest.NewSpanRecorder()
		d, err := dedupactivity.New(pool, dedupactivity.Options{TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			// Cancelled once the claim waits for the holder's lock, so the
			// cancel meets the wait, not the pool or the connect.
			defer cancel()
			require.Eventually(t, func() bool {
				return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'`, app) == 1
			}, 5*time.Second, 10*time.Millisecond)
		}()
		_, outcome, err := dedupactivity.Do(ctx, d, id, in, b.post)
		require.ErrorIs(t, err, context.Canceled, name)
		require.NotErrorIs(t, err, dedupactivity.ErrClaimTimeout, name)
		require.NotEqual(t, dedupactivity.OutcomeClaimTimeout, outcome, name)
		require.Len(t, spans.Ended(), 1, name)
		require.Equal(t, "context.Canceled", attr(spans.Ended()[0], attribute.Key("error.type")).AsString(), name) // not 57014, statement_timeout's
	}

	releaseHeld()
	require.Equal(t, int64(1), b.ledgerRows(t))
}

// TestResult reads what Do stored, through the data converter, and says
// whether an event was applied, as Applied does.
func TestResult(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, dedupactivity.Options{DataConverter: newXORConverter()})
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "n", ActivityType: "Post", Key: "k"}
	first, _, err := dedupactivity.Do(ctx, b.d, id, Transfer{Account: "a", Amount: 5}, b.post)
	require.NoError(t, err)

	var got Posting
	applied, err := b.d.Result(ctx, id, &got)
	require.NoError(t, err)
	require.True(t, applied)
	require.Equal(t, first, got)
	require.NotZero(t, got.EntryID)
	ok, err := b.d.Applied(ctx, id)
	require.NoError(t, err)
	require.True(t, ok)

	other := id
	other.Key = "never"
	got = Posting{EntryID: -1}
	applied, err = b.d.Result(ctx, other, &got)
	require.NoError(t, err)
	require.False(t, applied)
	require.Equal(t, Posting{EntryID: -1}, got, "left as it was")
	ok, err = b.d.Applied(ctx, other)
	require.NoError(t, err)
	require.False(t, ok)

	_, err = b.d.Result(ctx, dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey}, &got)
	require.ErrorIs(t, err, dedupactivity.ErrEmptyBusinessKey)

	discarding := setup(t, dedupactivity.Options{DiscardResults: true})
	_, _, err = dedupactivity.Do(ctx, discarding.d, id, Transfer{Account: "a", Amount: 5}, discarding.post)
	require.NoError(t, err)
	got = Posting{EntryID: -1}
	applied, err = discarding.d.Result(ctx, id, &got)
	require.NoError(t, err)
	require.True(t, applied)
	require.Equal(t, Posting{EntryID: -1}, got, "no result stored")

	var wrong []string
	_, err = b.d.Result(ctx, id, &wrong)
	require.ErrorIs(t, err, dedupactivity.ErrEncoding)
}

// TestReusedActivityIDIsTakenForADuplicate pins a documented limit (README,
// "Event identity"): a workflow that sets one ActivityID for two activities
// in a run, the second once the first closed, gets the first's result for
// the second, and the second's effect is not applied (counted by SQL).
func TestReusedActivityIDIsTakenForADuplicate(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	twice := func(ctx workflow.Context) ([]Posting, error) {
		ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{ActivityID: "post", StartToCloseTimeout: time.Minute})
		var out []Posting
		for _, amount := range []int64{1, 10} {
			var p Posting
			if err := workflow.ExecuteActivity(ctx, "Post", Transfer{Account: "a", Amount: amount}).Get(ctx, &p); err != nil {
				return nil, err
			}
			out = append(out, p)
		}
		return out, nil
	}
	var s testsuite.WorkflowTestSuite
	env := s.NewTestWorkflowEnvironment()
	env.RegisterActivityWithOptions(dedupactivity.Wrap(b.d, b.post), activity.RegisterOptions{Name: "Post"})
	env.RegisterWorkflow(twice)
	env.ExecuteWorkflow(twice)
	require.NoError(t, env.GetWorkflowError())
	var got []Posting
	require.NoError(t, env.GetWorkflowResult(&got))
	require.Equal(t, []Posting{{EntryID: 1, Balance: 1}, {EntryID: 1, Balance: 1}}, got, "the second gets the first's result")
	require.Equal(t, int64(1), b.ledgerRows(t), "the second's effect is not applied")
}

// TestClaimFirstDuplicateCallsNoEffect: a duplicate whose claim goes first
// (a business key, through Do and through a wrapped activity; a local
// activity run again) returns the
// stored result without calling the effect at all. The calls are counted on
// entry: the effect's own statements would fail on a duplicate's
// transaction, so counting its writes would not see a call.
func TestClaimFirstDuplicateCallsNoEffect(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	var calls atomic.Int64
	effect := func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		calls.Add(1)
		return b.post(ctx, tx, in)
	}
	ctx := context.Background()
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "order-do"}
	in := Transfer{Account: "a", Amount: 3}
	first, outcome, err := dedupactivity.Do(ctx, b.d, id, in, effect)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	again, outcome, err := dedupactivity.Do(ctx, b.d, id, in, effect)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, first, again)
	require.Equal(t, int64(1), calls.Load(), "Do's duplicate called no effect")

	fn := dedupactivity.Wrap(b.d, effect, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return "order-" + in.Account, nil }))
	in = Transfer{Account: "b", Amount: 4}
	first, err = deliver(t, "Post", fn, in)
	require.NoError(t, err)
	again, err = deliver(t, "Post", fn, in)
	require.NoError(t, err)
	require.Equal(t, first, again)
	require.Equal(t, int64(2), calls.Load(), "the activity's duplicate called no effect")
	require.Equal(t, int64(2), b.ledgerRows(t))

	// A local activity run again (a new workflow task runs it from attempt
	// 1; here a new test environment, with the same IDs) claims first too.
	local := dedupactivity.Wrap(b.d, effect)
	in = Transfer{Account: "a", Amount: 5}
	var s testsuite.WorkflowTestSuite
	v, err := s.NewTestActivityEnvironment().ExecuteLocalActivity(local, in)
	require.NoError(t, err)
	var localFirst, localAgain Posting
	require.NoError(t, v.Get(&localFirst))
	v, err = s.NewTestActivityEnvironment().ExecuteLocalActivity(local, in)
	require.NoError(t, err)
	require.NoError(t, v.Get(&localAgain))
	require.Equal(t, localFirst, localAgain)
	require.Equal(t, int64(3), calls.Load(), "the local activity's duplicate called no effect")
	require.Equal(t, int64(3), b.ledgerRows(t))
}
