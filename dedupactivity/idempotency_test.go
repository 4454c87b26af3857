package dedupactivity_test

import (
	"context"
	"encoding/hex"
	"errors"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// keyOf is the idempotency key IdempotencyKey documents for id: "dedup-"
// and the hex SHA-256 of its encoding.
func keyOf(id dedupactivity.Identity) string { return "dedup-" + hex.EncodeToString(hashOf(id)) }

// TestIdempotencyKeyIsStableAcrossAttempts: in a run-scoped wrapped
// activity, the key seen inside the effect and around it (in the activity,
// outside the effect) is the key of the activity's run-scoped identity, the
// same on every attempt: Temporal retries attempt 1 and 2 (failed after the
// wrapped call, and before the effect, the latter as a retry that never
// reaches the effect) and every attempt reads one key. Outside an activity
// there is none.
func TestIdempotencyKeyIsStableAcrossAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	var mu sync.Mutex
	var inEffect, around []string
	wrapped := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		k, _ := dedupactivity.IdempotencyKey(ctx)
		mu.Lock()
		inEffect = append(inEffect, k)
		attempt := activity.GetInfo(ctx).Attempt
		mu.Unlock()
		if attempt == 1 {
			return Posting{}, errors.New("effect failed on attempt 1") // rolled back: attempt 2 runs it again
		}
		return b.post(ctx, tx, in)
	})
	var info activity.Info
	driver := func(ctx context.Context, in Transfer) (Posting, error) {
		k, _ := dedupactivity.IdempotencyKey(ctx)
		mu.Lock()
		around = append(around, k)
		info = activity.GetInfo(ctx)
		mu.Unlock()
		p, err := wrapped(ctx, in)
		if err == nil && info.Attempt == 2 {
			return Posting{}, errors.New("worker lost before completion") // attempt 3 is a duplicate
		}
		return p, err
	}
	_, err := runPost(t, driver, "", Transfer{Account: "a", Amount: 3})
	require.NoError(t, err)
	require.Equal(t, int64(1), b.ledgerRows(t), "applied once")
	require.Equal(t, int32(3), info.Attempt)

	want := keyOf(dedupactivity.IdentityFromInfo(info))
	require.Regexp(t, `^dedup-[0-9a-f]{64}$`, want)
	require.Equal(t, []string{want, want, want}, around, "one key on every attempt, outside the effect")
	require.Equal(t, []string{want, want}, inEffect, "the same key inside the effect (attempt 3 is a duplicate)")

	k, ok := dedupactivity.IdempotencyKey(context.Background())
	require.False(t, ok, "not an activity")
	require.Empty(t, k)
}

// TestIdempotencyKeyOfABusinessKey: inside the effect of a business-keyed
// activity the key is the business key's event (namespace, activity type,
// key), the same in two workflows, where the activity's own run-scoped key
// (outside the effect) differs by workflow. The first workflow's effect
// fails non-retryably (rolled back), so the second's runs it again.
func TestIdempotencyKeyOfABusinessKey(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	var inEffect, around []string
	wrapped := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		k, _ := dedupactivity.IdempotencyKey(ctx)
		inEffect = append(inEffect, k)
		if len(inEffect) == 1 {
			return Posting{}, temporal.NewNonRetryableApplicationError("not yet", "NotYet", nil)
		}
		return b.post(ctx, tx, in)
	}, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return "order-" + in.Account, nil }))
	driver := func(ctx context.Context, in Transfer) (Posting, error) {
		k, _ := dedupactivity.IdempotencyKey(ctx)
		around = append(around, k)
		return wrapped(ctx, in)
	}
	for _, workflowID := range []string{"wf-1", "wf-2"} {
		_, err := runPost(t, driver, workflowID, Transfer{Account: "a", Amount: 1})
		if workflowID == "wf-1" {
			require.Error(t, err)
		} else {
			require.NoError(t, err)
		}
	}
	require.Equal(t, int64(1), b.ledgerRows(t))
	want := keyOf(dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: testNamespace, ActivityType: "Post", Key: "order-a"})
	require.Equal(t, []string{want, want}, inEffect, "the business key's event, in both workflows")
	require.Len(t, around, 2)
	require.NotEqual(t, around[0], around[1], "outside the effect: each workflow's run-scoped key")
	require.NotContains(t, around, want)
}
