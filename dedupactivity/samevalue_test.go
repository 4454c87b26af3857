package dedupactivity_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// A first delivery and its duplicates return one value, also where the data
// converter's round trip changes a value: the first delivery's is decoded
// from the bytes stored, as a duplicate's is.

// TestDoEmptyBytesBothWays: an empty []byte is stored without its data,
// which decodes as nil; before, the first delivery decoded the payload in
// memory and returned []byte{}.
func TestDoEmptyBytesBothWays(t *testing.T) {
	t.Parallel()
	first, again := doTwice(t, func(ctx context.Context, tx pgx.Tx, in int) ([]byte, error) { return []byte{}, nil })
	require.Equal(t, first, again, "first %#v, duplicate %#v", first, again)
}

// doTwice delivers one business-keyed event to Do twice, a first delivery
// then a duplicate (both checked as such), and returns what each returned.
func doTwice[Out any](t *testing.T, effect dedupactivity.EffectFunc[int, Out]) (first, again Out) {
	t.Helper()
	b := setup(t, dedupactivity.Options{})
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "k"}
	first, outcome, err := dedupactivity.Do(context.Background(), b.d, id, 7, effect)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	again, outcome, err = dedupactivity.Do(context.Background(), b.d, id, 7, effect)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	return first, again
}

// TestWrappedResultBothWays: the workflow reads one value from a wrapped
// activity's first delivery and from its duplicate. An int64 above 2^53 in
// an `any` decodes as a float64; before, the first delivery handed the SDK
// the effect's own value (exact) and a duplicate the decoded one (rounded),
// so a workflow reading an int64 got two numbers.
func TestWrappedResultBothWays(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	const big = int64(1<<53 + 1)
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in int) (map[string]any, error) {
		return map[string]any{"ID": big}, nil
	})
	type typed struct{ ID int64 }
	get := func() typed {
		var s testsuite.WorkflowTestSuite
		env := s.NewTestActivityEnvironment()
		env.RegisterActivityWithOptions(fn, activity.RegisterOptions{Name: "Big"})
		val, err := env.ExecuteActivity("Big", 1)
		require.NoError(t, err)
		var out typed // as the workflow declares the result
		require.NoError(t, val.Get(&out))
		return out
	}
	first := get()
	again := get()
	require.Equal(t, int64(1), b.markers(t), "one event, applied once")
	require.Equal(t, int64(float64(big)), first.ID, "as the converter's round trip leaves it")
	require.Equal(t, first, again, "first %d, duplicate %d", first.ID, again.ID)
}

// TestClaimTxStoredAfterComplete: after Complete, Stored is the result as a
// duplicate's ClaimTx gets it, so a caller that returns Stored returns one
// value on both paths (here an int64 above 2^53 in an any, which the
// converter's round trip turns into a float64).
func TestClaimTxStoredAfterComplete(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "claimtx-any"}
	deliver := func() (map[string]any, dedupactivity.Outcome) {
		var out map[string]any
		var outcome dedupactivity.Outcome
		require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
			c, err := dedupactivity.ClaimTx[map[string]any](ctx, b.d, tx, id, 1)
			if err != nil {
				return err
			}
			outcome = c.Outcome()
			if outcome == dedupactivity.OutcomeClaimed {
				if err := c.Complete(ctx, map[string]any{"n": int64(1<<53 + 1)}); err != nil {
					return err
				}
			}
			out = c.Stored()
			return nil
		}))
		return out, outcome
	}
	first, outcome := deliver()
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	again, outcome := deliver()
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, map[string]any{"n": float64(1<<53 + 1)}, first)
	require.Equal(t, first, again, "first %#v, duplicate %#v", first, again)
}

// label is a result held in an interface the converter cannot decode into.
type label struct{ S string }

func (l label) String() string { return l.S }

// TestResultThatCannotBeDecodedBack: a first delivery whose result the
// converter encodes but cannot decode (here a non-empty interface, which
// JSON cannot fill) fails before it commits, non-retryable at the activity
// edge as a result it cannot encode, with nothing applied: its every
// duplicate would have failed to read the stored result (retryable), so
// retries went on until the activity's ScheduleToClose with the effect
// applied. ClaimTx's Complete refuses it the same way, storing nothing.
func TestResultThatCannotBeDecodedBack(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	effect := func(ctx context.Context, tx pgx.Tx, in Transfer) (fmt.Stringer, error) {
		if _, err := b.post(ctx, tx, in); err != nil {
			return nil, err
		}
		return label{"posted"}, nil
	}
	for _, id := range []dedupactivity.Identity{
		{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "stringer"},
		{Kind: dedupactivity.KindActivity, Namespace: "default", WorkflowID: "w", RunID: "r", ActivityID: "1"}, // rides
	} {
		_, _, err := dedupactivity.Do(context.Background(), b.d, id, Transfer{Account: "a", Amount: 1}, effect)
		require.ErrorIs(t, err, dedupactivity.ErrEncoding, id.Kind)
		require.ErrorContains(t, err, "fmt.Stringer")
	}
	fn := dedupactivity.Wrap(b.d, effect)
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	f := temporal.GetDefaultFailureConverter().ErrorToFailure(err)
	require.Equal(t, dedupactivity.ErrTypeEncoding, f.GetApplicationFailureInfo().GetType(), "%v", err)
	require.True(t, f.GetApplicationFailureInfo().GetNonRetryable())

	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	c, err := dedupactivity.ClaimTx[fmt.Stringer](ctx, b.d, tx, dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "claimtx"}, 1)
	require.NoError(t, err)
	require.ErrorIs(t, c.Complete(ctx, label{"posted"}), dedupactivity.ErrEncoding)
	var stored bool
	require.NoError(t, tx.QueryRow(ctx, `SELECT result IS NOT NULL FROM dedup_marker`).Scan(&stored))
	require.False(t, stored, "Complete stored nothing")
	require.NoError(t, tx.Rollback(ctx))

	require.Zero(t, b.ledgerRows(t), "nothing applied")
	require.Zero(t, b.markers(t))
}
