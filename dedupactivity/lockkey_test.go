package dedupactivity_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// TestEventLockKey: the claim's advisory lock key is per table, so the same
// identity on two marker tables does not wait; and another holder of the
// same key (here an application's own advisory lock) only makes the claim
// wait, within the claim wait, and decides nothing.
func TestEventLockKey(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{ClaimWait: 300 * time.Millisecond})
	ctx := context.Background()
	other, err := dedupactivity.New(b.pool, dedupactivity.Options{Table: "other_marker", ClaimWait: 300 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, other.Migrate(ctx))
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "k"}
	in := Transfer{Account: "a", Amount: 1}
	require.NotEqual(t, dedupactivity.EventLockKey(b.d, id), dedupactivity.EventLockKey(other, id))

	// Hold the event on the first table, mid-transaction.
	holding, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	dedupactivity.SetAfterClaimHook(b.d, func(ctx context.Context, tx pgx.Tx) error {
		once.Do(func() { close(holding); <-release })
		return nil
	})
	holder := make(chan error, 1)
	go func() { _, _, err := dedupactivity.Do(ctx, b.d, id, in, b.post); holder <- err }()
	<-holding
	_, outcome, err := dedupactivity.Do(ctx, other, id, in, b.post)
	require.NoError(t, err, "another table's claim does not wait for this one")
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	close(release)
	require.NoError(t, <-holder)

	// An application holding the same key: the claim waits, times out,
	// writes nothing; once the key is free, it claims.
	app, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	defer app.Release()
	fresh := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "fresh"}
	_, err = app.Exec(ctx, `SELECT pg_advisory_lock($1)`, dedupactivity.EventLockKey(b.d, fresh))
	require.NoError(t, err)
	markers := b.markers(t)
	_, outcome, err = dedupactivity.Do(ctx, b.d, fresh, in, b.post)
	require.ErrorIs(t, err, dedupactivity.ErrClaimTimeout)
	require.Equal(t, dedupactivity.OutcomeClaimTimeout, outcome)
	require.Equal(t, markers, b.markers(t))
	_, err = app.Exec(ctx, `SELECT pg_advisory_unlock($1)`, dedupactivity.EventLockKey(b.d, fresh))
	require.NoError(t, err)
	_, outcome, err = dedupactivity.Do(ctx, b.d, fresh, in, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
}
