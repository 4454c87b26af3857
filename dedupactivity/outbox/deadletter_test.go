package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
)

// TestResolveDeadLetters: a person's tools for the dead letters the
// reconciler leaves to them. DeadLetters lists them, the longest dead
// first; Requeue sends one again (applied once, counted at the destination
// by SQL), also one made dead for stopping the relay; MarkApplied and
// MarkRejected settle one without a send, and the reconciler asks about
// neither again. Each acts only on a dead message.
func TestResolveDeadLetters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	ctx := context.Background()
	rv.down.Store(true)
	keys := b.placeN(t, 3)
	r := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{MaxAttempts: 1})
	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Dead: 3}, res)
	rv.down.Store(false)
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET settled_at = settled_at - interval '1 hour' WHERE idempotency_key = $1`, keys[2])
	require.NoError(t, err)

	letters, err := b.ob.DeadLetters(ctx, 10)
	require.NoError(t, err)
	require.Len(t, letters, 3)
	require.Equal(t, keys[2], letters[0].Key, "the longest dead first")
	for _, l := range letters {
		require.Contains(t, keys, l.Key)
		require.Equal(t, "receipts", l.Destination)
		require.Equal(t, "receipt", l.Name)
		require.Equal(t, 1, l.Attempts)
		require.Zero(t, l.Requeues)
		require.Contains(t, l.LastError, "503")
		require.WithinDuration(t, time.Now(), l.CreatedAt, time.Minute)
		died := time.Now()
		if l.Key == keys[2] {
			died = died.Add(-time.Hour)
		}
		require.WithinDuration(t, died, l.DiedAt, time.Minute)
		require.WithinDuration(t, time.Now(), l.UnackedSince, time.Minute, "its one send began now")
	}
	top, err := b.ob.DeadLetters(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, letters[:1], top)
	_, err = b.ob.DeadLetters(ctx, 0)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)

	// Requeue: sent again with a fresh budget, stalls included (the relay
	// makes a message with MaxAttempts stalls dead without sending it).
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET stalls = 5, checked_at = now() WHERE idempotency_key = $1`, keys[0])
	require.NoError(t, err)
	require.NoError(t, b.ob.Requeue(ctx, keys[0]))
	// Sent before: unacknowledged from the Requeue on (the destination may
	// still apply a send it had not finished when the person asked).
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'pending'
		AND tries = 0 AND stalls = 0 AND requeues = 0 AND next_attempt_at <= now() AND settled_at IS NULL AND checked_at IS NULL
		AND unacked_since >= now() - interval '1 minute'`, keys[0]))
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res)
	require.Equal(t, 1, rv.applied(t, keys[0]))
	err = b.ob.Requeue(ctx, keys[0])
	require.ErrorIs(t, err, outbox.ErrNotDead)
	require.ErrorContains(t, err, "it is sent")

	// A dead letter never sent stays never sent: the relay sends it
	// whatever its age.
	placed, _, err := b.place(t, "never-sent", []string{"receipt"}, nil)
	require.NoError(t, err)
	unsent := placed[0]
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'dead', settled_at = now(), created_at = now() - interval '2 days'
		WHERE idempotency_key = $1`, unsent)
	require.NoError(t, err)
	letters, err = b.ob.DeadLetters(ctx, 10)
	require.NoError(t, err)
	require.Len(t, letters, 3)
	require.Equal(t, unsent, letters[2].Key)
	require.True(t, letters[2].UnackedSince.IsZero(), "never sent")
	require.NoError(t, b.ob.Requeue(ctx, unsent))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'pending'
		AND attempts = 0 AND unacked_since IS NULL`, unsent))
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res)
	require.Equal(t, 1, rv.applied(t, unsent))

	// MarkApplied and MarkRejected: settled, not sent.
	require.NoError(t, b.ob.MarkApplied(ctx, keys[1]))
	require.ErrorIs(t, b.ob.MarkRejected(ctx, keys[2], "account\x00closed"), outbox.ErrInvalidConfig)
	require.NoError(t, b.ob.MarkRejected(ctx, keys[2], "account closed, told the customer"))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'applied'
		AND settled_at > now() - interval '1 minute' AND last_error LIKE '%503%'`, keys[1]))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'rejected'
		AND settled_at > now() - interval '1 minute' AND last_error = 'account closed, told the customer'`, keys[2]))
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, res)
	require.Zero(t, rv.applied(t, keys[1]))
	require.Zero(t, rv.applied(t, keys[2]))
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), UnackedAfter: time.Millisecond})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, rep.Checked, "nothing left to ask about")
	letters, err = b.ob.DeadLetters(ctx, 10)
	require.NoError(t, err)
	require.Empty(t, letters)

	for name, resolve := range map[string]func(string) error{
		"Requeue":      func(k string) error { return b.ob.Requeue(ctx, k) },
		"MarkApplied":  func(k string) error { return b.ob.MarkApplied(ctx, k) },
		"MarkRejected": func(k string) error { return b.ob.MarkRejected(ctx, k, "") },
	} {
		require.ErrorIs(t, resolve("no-such-key"), outbox.ErrNoMessage, name)
		err := resolve(keys[1])
		require.ErrorIs(t, err, outbox.ErrNotDead, name)
		require.ErrorContains(t, err, "it is applied", name)
	}
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'applied'`, keys[1]), "left as it was")
}

// TestMarkRejectedKeepsTheLastError: without a reason, the send's error
// stays as the message's last error.
func TestMarkRejectedKeepsTheLastError(t *testing.T) {
	t.Parallel()
	b := setup(t)
	keys := b.deadLetters(t, 2)
	ctx := context.Background()
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET last_error = '422 Unprocessable Entity'`)
	require.NoError(t, err)
	require.NoError(t, b.ob.MarkRejected(ctx, keys[0], ""))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'rejected' AND last_error = '422 Unprocessable Entity'`, keys[0]))
	letters, err := b.ob.DeadLetters(ctx, 10)
	require.NoError(t, err)
	require.Len(t, letters, 1)
	require.Equal(t, keys[1], letters[0].Key)
}

// TestRequeueOfADeadLetterTheRelayNeverSent: a message the relay made dead
// without sending it (its headers could not be read) has attempts 1 but was
// never sent: no destination has its key. A person fixes its headers and
// re-queues it; it must stay never sent (unacked_since NULL), so that the
// relay sends it whatever the time since, and not make it dead as "first
// sent longer ago than KeyRetention" when the relays come back a day
// later. Counted at the destination by SQL.
func TestRequeueOfADeadLetterTheRelayNeverSent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	ctx := context.Background()
	keys := b.placeN(t, 1)
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET headers = '[1]'`)
	require.NoError(t, err)
	r := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{})
	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Dead: 1}, res)
	letters, err := b.ob.DeadLetters(ctx, 10)
	require.NoError(t, err)
	require.Len(t, letters, 1)
	require.Equal(t, 1, letters[0].Attempts)
	require.True(t, letters[0].UnackedSince.IsZero(), "never sent")

	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET headers = '{}'`)
	require.NoError(t, err)
	require.NoError(t, b.ob.Requeue(ctx, keys[0]))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND unacked_since IS NULL`), "still never sent")

	// A day later: the relays were down.
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET created_at = created_at - interval '25 hours',
	unacked_since = unacked_since - interval '25 hours', next_attempt_at = now()`)
	require.NoError(t, err)
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res)
	require.Equal(t, 1, rv.applied(t, keys[0]))
}
