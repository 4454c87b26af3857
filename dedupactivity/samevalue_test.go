package dedupactivity_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
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
