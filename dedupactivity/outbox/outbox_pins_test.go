package outbox_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
)

// TestEnqueueRefusesALongName pins the 100-byte bound of Message.Name
// ([A-Za-z0-9._-]{1,100}): a derived key is "dedup-<64 hex>:<name>:<n>",
// and only with the bound does it stay within the 255 bytes that HTTPSender
// and idemhttp accept for an Idempotency-Key. A name of 100 bytes is
// enqueued with a key of at most 255 bytes; one of 101 is refused with
// ErrInvalidMessage and writes nothing (counted by SQL). A bound removed
// would let a long name through, to go dead at every send.
func TestEnqueueRefusesALongName(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	keys, _, err := b.place(t, "o1", []string{strings.Repeat("n", 100)}, nil)
	require.NoError(t, err)
	require.Len(t, keys, 1)
	require.LessOrEqual(t, len(keys[0]), 255, "the derived key fits an Idempotency-Key")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox`))

	for _, name := range []string{strings.Repeat("n", 101), strings.Repeat("n", 200)} {
		_, _, err := b.place(t, "long-"+name, []string{name}, nil)
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, len(name))
		err = pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
			_, err := b.ob.Enqueue(ctx, tx, outbox.Message{Destination: "d", Name: name, Key: "explicit-" + name[:3]})
			return err
		})
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, len(name))
	}
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox`), "nothing more was written")
}

// TestEnqueueRefusesAnUnstorableDestinationWithAName pins Enqueue's own
// check of Destination (valid UTF-8 without NUL) when Name is given: with
// Name unset the name check, which defaults Name to Destination, hid it.
// Without the check the INSERT fails in PostgreSQL (SQLSTATE 22021), which
// is not ErrInvalidMessage and aborts the effect's transaction, so the
// effect could not even go on without the message. With it the error is
// ErrInvalidMessage and the transaction still runs statements.
func TestEnqueueRefusesAnUnstorableDestinationWithAName(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for _, dest := range []string{"rece\x00ipts", "rece\xffipts"} {
		err := pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
			_, err := b.ob.Enqueue(ctx, tx, outbox.Message{Destination: dest, Name: "receipt", Key: "k"})
			require.ErrorIs(t, err, outbox.ErrInvalidMessage, "%q", dest)
			_, err = tx.Exec(ctx, `INSERT INTO effect (order_id) VALUES ('still-running')`)
			require.NoError(t, err, "the transaction was not aborted by a failed statement")
			return errors.New("roll back")
		})
		require.Error(t, err)
	}
	require.Zero(t, b.count(t, `SELECT count(*) FROM dedup_outbox`))
}

// TestBackoffDoublesToTheCapWithJitter pins the retry wait of
// docs/outbox.md for each failure count n: MinBackoff * 2^(n-1), capped at
// MaxBackoff, jittered to [half, all]. MaxBackoff (30s) is not MinBackoff
// (10s) times a power of two, so a cap applied only after an overshoot
// shows. 16 messages per n fail once in one pass; their next_attempt_at,
// read by SQL, must lie within [now before the pass + half the wait, now
// after the pass + the wait], and the waits of one n must spread (jitter),
// not all fall within the pass's own duration. The bounds are exact, so the
// test cannot fail on correct code; the spread fails by chance with
// probability under 1e-7.
func TestBackoffDoublesToTheCapWithJitter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const perN = 16
	// failures counted after this pass's one -> the wait before jitter
	wait := map[int]time.Duration{1: 10 * time.Second, 2: 20 * time.Second, 3: 30 * time.Second, 6: 30 * time.Second}
	ns := []int{1, 2, 3, 6}
	keys := b.placeN(t, perN*len(ns))
	failures := map[string]int{}
	for i, k := range keys {
		n := ns[i/perN]
		failures[k] = n
		_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET tries = $2, attempts = $2 WHERE idempotency_key = $1`, k, n-1)
		require.NoError(t, err)
	}
	r := b.relay(t, nil, outbox.RelayConfig{MaxAttempts: 100, MinBackoff: 10 * time.Second, MaxBackoff: 30 * time.Second,
		Sender: outbox.SenderFunc(func(context.Context, outbox.Delivery) error { return errors.New("unavailable") })})
	var before, after time.Time
	require.NoError(t, b.schema.Pool.QueryRow(ctx, `SELECT now()`).Scan(&before))
	_, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.NoError(t, b.schema.Pool.QueryRow(ctx, `SELECT now()`).Scan(&after))

	type row struct {
		Key   string
		Tries int
		State string
		Next  time.Time
	}
	// Read whole before any assertion, which would leave the pool's
	// connection taken (and the test's cleanup waiting for it).
	rows, err := b.schema.Pool.Query(ctx, `SELECT idempotency_key, tries, state, next_attempt_at FROM dedup_outbox`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	require.NoError(t, err)
	require.Len(t, got, len(keys))
	next := map[int][]time.Time{}
	for _, r := range got {
		n := failures[r.Key]
		require.Equal(t, "pending", r.State, r.Key)
		require.Equal(t, n, r.Tries, r.Key)
		const slack = time.Millisecond // timestamps are in microseconds
		require.GreaterOrEqual(t, r.Next.Sub(before), wait[n]/2-slack, "failure %d: at least half of %s", n, wait[n])
		require.LessOrEqual(t, r.Next.Sub(after), wait[n]+slack, "failure %d: at most %s", n, wait[n])
		next[n] = append(next[n], r.Next)
	}
	for _, n := range ns {
		require.Len(t, next[n], perN)
		spread := slices.MaxFunc(next[n], time.Time.Compare).Sub(slices.MinFunc(next[n], time.Time.Compare))
		require.Greater(t, spread, wait[n]/8, "failure %d: the waits are jittered", n)
	}
}

// TestMultipleChoicesIsNotADelivery pins the 2xx range of HTTPSender's
// success: a 300 Multiple Choices is a 3xx, permanent (dead at once), not a
// delivery. The destination counts one request; the row is dead, by SQL.
func TestMultipleChoicesIsNotADelivery(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, func(string, int) int { return http.StatusMultipleChoices })
	keys := b.placeN(t, 1)
	_, err := b.relay(t, dest, outbox.RelayConfig{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead' AND last_error LIKE '%300%'`))
	require.Equal(t, 1, dest.count(keys[0]))
}

// TestEndlessAnswerBodyDoesNotHoldTheSend pins drainClose's bound
// (maxDrainedBody): a destination that accepts a message and then streams
// an answer without end is read up to 64 KiB and closed, so the send
// returns at once, not when HTTPSender's Timeout cuts the read. The server
// stops writing by itself after 20 seconds.
func TestEndlessAnswerBodyDoesNotHoldTheSend(t *testing.T) {
	t.Parallel()
	var requests atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusAccepted)
		chunk := []byte(strings.Repeat("x", 4096))
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			if _, err := w.Write(chunk); err != nil {
				return
			}
			if f, ok := w.(http.Flusher); ok {
				f.Flush()
			}
		}
	}))
	t.Cleanup(srv.Close)
	const timeout = 6 * time.Second
	s, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{"d": srv.URL}, Timeout: timeout})
	require.NoError(t, err)
	start := time.Now()
	require.NoError(t, s.Send(context.Background(), outbox.Delivery{Key: "k", Destination: "d", Payload: []byte(`{}`)}))
	require.Less(t, time.Since(start), timeout/2, "the rest of the answer was not read to the Timeout")
	require.Equal(t, int32(1), requests.Load())
}

// TestReconcilerLeavesAHeldLeaseAlone pins the reconciler's condition on a
// sending message: only one whose lease expired is asked about. A message
// unacknowledged for long but leased right now (a relay is sending it) is
// left as it is, so a re-queue cannot make a second relay send it while
// the first still does. Checked by SQL, and by the checker never asked.
func TestReconcilerLeavesAHeldLeaseAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.placeN(t, 1)
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'sending', attempts = 1, tries = 1,
	lease_until = now() + interval '1 hour', unacked_since = now() - interval '1 hour'`)
	require.NoError(t, err)
	var asked atomic.Int32
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{UnackedAfter: time.Minute,
		Checker: outbox.CheckerFunc(func(context.Context, outbox.Delivery) (bool, error) { asked.Add(1); return false, nil })})
	require.NoError(t, err)
	_, err = rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, asked.Load())
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sending' AND attempts = 1 AND lease_until > now()`))
}

// TestHTTPCheckerRejectedOnlyWhenNotApplied pins the "applied":false of a
// refusal: a 409 whose body says applied true is no refusal (an answer
// that contradicts itself is unknown), whatever its status.
func TestHTTPCheckerRejectedOnlyWhenNotApplied(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusConflict)
		_, _ = io.WriteString(w, `{"applied":true,"status":422}`)
	}))
	t.Cleanup(srv.Close)
	c := outbox.HTTPChecker{URL: func(_, key string) string { return srv.URL + "/" + key }}
	applied, err := c.Applied(context.Background(), outbox.Delivery{Key: "k", Destination: "d"})
	require.False(t, applied)
	require.Error(t, err)
	require.NotErrorIs(t, err, outbox.ErrRejected)
}

// TestReconcilerRequeueStartsTheUnackedClockAgain pins the re-queue of a
// pending message unacknowledged past UnackedAfter: it is due at once and
// its unacknowledged time starts again (from its next lease), so the next
// run does not ask about it again before UnackedAfter has passed anew. The
// test's own checker counts the questions; the row is read by SQL.
func TestReconcilerRequeueStartsTheUnackedClockAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.placeN(t, 1)
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET attempts = 1, tries = 1, next_attempt_at = now() + interval '1 hour',
	unacked_since = now() - interval '1 hour'`)
	require.NoError(t, err)
	var asked atomic.Int32
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{UnackedAfter: time.Minute,
		Checker: outbox.CheckerFunc(func(context.Context, outbox.Delivery) (bool, error) { asked.Add(1); return false, nil })})
	require.NoError(t, err)
	for range 2 {
		_, err = rc.Reconcile(ctx)
		require.NoError(t, err)
	}
	require.Equal(t, int32(1), asked.Load(), "asked once, not again at the next run")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND next_attempt_at <= now() AND unacked_since IS NULL`))
}

// TestLeaseEndedBeforeTheSendBeginsIsNotSent pins begin's check of the
// lease's end in the database, apart from the attempts fence: a message
// whose lease ended while the relay sent the one before it (the process
// paused, say), and that no other relay took yet, is not sent by that
// relay, which no longer holds it: another relay could claim and send it
// at the same moment. The destination counts no request for it in that
// pass; the row stays leased and unbegun (SQL); the next relay sends it
// once, its try given back.
func TestLeaseEndedBeforeTheSendBeginsIsNotSent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	keys := b.placeN(t, 2)
	ctx := context.Background()
	deliver := httpSender(t, dest.URL)
	// BatchSize 3: the pass ends with its one batch, which would otherwise be
	// followed by a claim that takes the ended lease over, rightly.
	first := b.relay(t, dest, outbox.RelayConfig{Lease: time.Minute, BatchSize: 3, Sender: outbox.SenderFunc(func(ctx context.Context, d outbox.Delivery) error {
		if d.Key == keys[0] {
			_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET lease_until = now() - interval '1 second' WHERE idempotency_key = $1`, keys[1])
			require.NoError(t, err)
		}
		return deliver.Send(ctx, d)
	})})
	_, err := first.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, dest.count(keys[0]))
	require.Zero(t, dest.count(keys[1]), "not sent under a lease that ended")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'sending' AND NOT in_send AND attempts = 1`, keys[1]))

	_, err = b.relay(t, dest, outbox.RelayConfig{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, dest.count(keys[1]))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent' AND tries = 1`))
}

// takeOverDuringSend runs relay A on the placed messages keys (leased
// together, keys[0] first); while A sends keys[0], the lease of
// keys[len-1] ends and relay B claims it and starts sending it (to dest,
// for real), and holds that send until A has returned; then aSend decides
// how A's own send ends. It returns once both relays are done.
func takeOverDuringSend(t *testing.T, b *testBundle, dest *destination, keys []string, aSend func(ctx context.Context, cancel context.CancelFunc) error) {
	t.Helper()
	taken := keys[len(keys)-1]
	deliver := httpSender(t, dest.URL)
	inSend, release, bDone := make(chan struct{}), make(chan struct{}), make(chan struct{})
	bRelay := b.relay(t, dest, outbox.RelayConfig{Lease: time.Minute, Sender: outbox.SenderFunc(func(ctx context.Context, d outbox.Delivery) error {
		close(inSend)
		<-release
		return deliver.Send(ctx, d)
	})})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	a := b.relay(t, dest, outbox.RelayConfig{Lease: time.Minute, BatchSize: len(keys), MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
		Sender: outbox.SenderFunc(func(ctx context.Context, d outbox.Delivery) error {
			if d.Key != keys[0] {
				return deliver.Send(ctx, d)
			}
			_, err := b.schema.Pool.Exec(context.Background(), `UPDATE dedup_outbox SET lease_until = now() - interval '1 second' WHERE idempotency_key = $1`, taken)
			require.NoError(t, err)
			go func() {
				defer close(bDone)
				_, err := bRelay.RunOnce(context.Background())
				assert.NoError(t, err)
			}()
			<-inSend
			return aSend(ctx, cancel)
		})})
	_, _ = a.RunOnce(ctx)
	close(release)
	<-bDone
}

// TestFailureUnderALostLeaseChangesNothing pins the attempts fence of a
// failure's record: relay A, whose send failed after its lease ended and
// relay B took the message over and is sending it, records nothing. Without
// the fence A's failure made the row pending while B sent it; B's
// acknowledgement then failed, and the message was sent again. By SQL the
// row is sent under B's lease (attempts 2); the destination got one request,
// also after another pass.
func TestFailureUnderALostLeaseChangesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	keys := b.placeN(t, 1)
	takeOverDuringSend(t, b, dest, keys, func(context.Context, context.CancelFunc) error { return errors.New("unavailable") })
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent' AND attempts = 2`))
	time.Sleep(5 * time.Millisecond) // past any backoff A could have set
	_, err := b.relay(t, dest, outbox.RelayConfig{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, dest.count(keys[0]), "sent once, by B")
}

// TestReleaseUnderALostLeaseChangesNothing pins the attempts fence of
// release: relay A, stopped during a send, gives back the rest of its
// batch; a message of it whose lease ended and that relay B took over and
// is sending is not given back (made pending under B). Without the fence B's
// acknowledgement failed and the message was sent again. By SQL the message
// is sent under B's lease; the destination got one request for it, also
// after another pass.
func TestReleaseUnderALostLeaseChangesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	keys := b.placeN(t, 2)
	takeOverDuringSend(t, b, dest, keys, func(ctx context.Context, cancel context.CancelFunc) error {
		cancel() // A stops during its send of keys[0]
		return ctx.Err()
	})
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'sent' AND attempts = 2`, keys[1]))
	_, err := b.relay(t, dest, outbox.RelayConfig{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, dest.count(keys[1]), "sent once, by B")
	require.Equal(t, 1, dest.count(keys[0]), "the message A gave back is sent by the last pass")
}

// TestRecordedFailureResetsTheStalls pins "a recorded failure resets the
// stalls" (docs/outbox.md): stalls count sends that began and recorded
// nothing in a row, so a message that stalled twice, then failed with an
// answer, then stalled once more, has one stall, not three, and is sent
// again (MaxAttempts 3), not made dead unsent. The destination counts the
// requests; the row's state is read by SQL.
func TestRecordedFailureResetsTheStalls(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, func(_ string, n int) int {
		if n == 1 {
			return http.StatusServiceUnavailable
		}
		return http.StatusOK
	})
	keys := b.placeN(t, 1)
	ctx := context.Background()
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET stalls = 2, attempts = 2`)
	require.NoError(t, err)
	r := b.relay(t, dest, outbox.RelayConfig{MaxAttempts: 3, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond})
	_, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND last_error LIKE '%503%'`))
	// The next send begins and its process stops: leased, marked in_send,
	// the lease ended.
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'sending', attempts = attempts + 1, tries = tries + 1, in_send = true,
	lease_until = now() - interval '1 second'`)
	require.NoError(t, err)
	_, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent' AND stalls = 1`))
	require.Equal(t, 2, dest.count(keys[0]), "sent again after its one stall")
}
