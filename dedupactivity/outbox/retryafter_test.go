package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
)

// waitSeconds is the wait, in seconds from now, before the only message's
// next send, as the outbox table holds it.
func (b *testBundle) waitSeconds(t *testing.T) float64 {
	t.Helper()
	var s float64
	require.NoError(t, b.schema.Pool.QueryRow(context.Background(),
		`SELECT extract(epoch FROM next_attempt_at - now()) FROM dedup_outbox WHERE state = 'pending'`).Scan(&s))
	return s
}

// answering starts a server that answers every request with status and,
// unless retryAfter is "", that Retry-After header; hits counts requests.
func answering(t *testing.T, status int, retryAfter string) (srv *httptest.Server, hits *atomic.Int64) {
	t.Helper()
	hits = new(atomic.Int64)
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if retryAfter != "" {
			w.Header().Set("Retry-After", retryAfter)
		}
		w.WriteHeader(status)
	}))
	t.Cleanup(srv.Close)
	return srv, hits
}

// TestHTTPSenderReadsRetryAfter: a retryable status's Retry-After header,
// in seconds or as an HTTP-date, is the StatusError's RetryAfter; one that
// cannot be read, or a date past, is 0.
func TestHTTPSenderReadsRetryAfter(t *testing.T) {
	t.Parallel()
	header := map[string]string{
		"seconds": "120",
		"date":    time.Now().Add(90 * time.Second).UTC().Format(http.TimeFormat),
		"past":    time.Now().Add(-time.Hour).UTC().Format(http.TimeFormat),
		"bad":     "soon",
		"minus":   "-5",
		"none":    "",
		"huge":    "99999999999999999999",
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if v := header[r.Header.Get(outbox.IdempotencyKeyHeader)]; v != "" {
			w.Header().Set("Retry-After", v)
		}
		w.WriteHeader(http.StatusTooManyRequests)
	}))
	t.Cleanup(srv.Close)
	s := httpSender(t, srv.URL)
	for key, want := range map[string][2]time.Duration{
		"seconds": {120 * time.Second, 120 * time.Second},
		"date":    {80 * time.Second, 90 * time.Second}, // the date has whole seconds
		"past":    {0, 0},
		"bad":     {0, 0},
		"minus":   {0, 0},
		"none":    {0, 0},
		"huge":    {100 * 365 * 24 * time.Hour, time.Duration(1<<63 - 1)},
	} {
		err := s.Send(context.Background(), outbox.Delivery{Key: key, Destination: "receipts", Payload: []byte(`{}`), Attempt: 1})
		var se *outbox.StatusError
		require.ErrorAs(t, err, &se, key)
		require.Equal(t, http.StatusTooManyRequests, se.StatusCode, key)
		require.GreaterOrEqual(t, se.RetryAfter, want[0], key)
		require.LessOrEqual(t, se.RetryAfter, want[1], key)
		require.NotErrorIs(t, err, outbox.ErrPermanent, key)
	}
}

// TestRelayWaitsWhatTheDestinationAsks: a retryable failure that asks for a
// wait (a 429's Retry-After through HTTPSender, or RetryAfter from any
// Sender) is not sent again before it, longer than the backoff would be, and
// never past MaxBackoff; a permanent error asking for a wait is still dead,
// and a shorter wait than the backoff leaves the backoff.
func TestRelayWaitsWhatTheDestinationAsks(t *testing.T) {
	t.Parallel()
	busy := errors.New("busy")
	retryAfter, _ := answering(t, http.StatusTooManyRequests, "120")
	for _, tc := range []struct {
		name     string
		sender   func(t *testing.T) outbox.Sender
		max      time.Duration // MaxBackoff
		min, top float64       // bounds of the wait, in seconds
		dead     bool
	}{
		{name: "RetryAfterHeader", sender: func(t *testing.T) outbox.Sender { return httpSender(t, retryAfter.URL) }, max: time.Hour, min: 119, top: 120},
		{name: "CappedAtMaxBackoff", sender: func(t *testing.T) outbox.Sender { return httpSender(t, retryAfter.URL) }, max: 30 * time.Second, min: 29, top: 30},
		{name: "RetryAfterFromASender", sender: func(*testing.T) outbox.Sender {
			return outbox.SenderFunc(func(context.Context, outbox.Delivery) error {
				return outbox.RetryAfter(fmt.Errorf("rate limited: %w", busy), time.Minute)
			})
		}, max: time.Hour, min: 59, top: 60},
		{name: "ShorterThanTheBackoff", sender: func(*testing.T) outbox.Sender {
			return outbox.SenderFunc(func(context.Context, outbox.Delivery) error { return outbox.RetryAfter(busy, time.Millisecond) })
		}, max: time.Hour, min: 4, top: 10},
		{name: "PermanentStaysDead", sender: func(*testing.T) outbox.Sender {
			return outbox.SenderFunc(func(context.Context, outbox.Delivery) error {
				return outbox.RetryAfter(fmt.Errorf("%w: refused", outbox.ErrPermanent), time.Minute)
			})
		}, max: time.Hour, dead: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			b.placeN(t, 1)
			r := b.relay(t, nil, outbox.RelayConfig{Sender: tc.sender(t), MinBackoff: 10 * time.Second, MaxBackoff: tc.max})
			res, err := r.RunOnce(context.Background())
			require.NoError(t, err)
			if tc.dead {
				require.Equal(t, outbox.RelayResult{Dead: 1}, res)
				require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead'`))
				return
			}
			require.Equal(t, outbox.RelayResult{Retried: 1}, res)
			w := b.waitSeconds(t)
			require.GreaterOrEqual(t, w, tc.min)
			require.LessOrEqual(t, w, tc.top)
		})
	}
}

// TestRelayPausesADestinationThatAsksToWait: once a send's answer asks for
// a wait, the relay sends that destination nothing until it is over: the
// batch's other messages for it go back unsent, due after the wait and
// their try not counted, and later claims leave the destination out, while
// other destinations' messages are sent. Another relay learns the wait by
// sending once.
func TestRelayPausesADestinationThatAsksToWait(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	limited, limitedHits := answering(t, http.StatusTooManyRequests, "120")
	other, otherHits := answering(t, http.StatusCreated, "")
	keys := b.placeN(t, 6)
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET destination = 'other' WHERE idempotency_key = ANY($1)`, keys[4:])
	require.NoError(t, err)
	sender, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{"receipts": limited.URL, "other": other.URL}})
	require.NoError(t, err)
	var logged strings.Builder
	cfg := outbox.RelayConfig{Sender: sender, MaxBackoff: time.Hour, Logger: slog.New(slog.NewTextHandler(&logged, nil))}
	r := b.relay(t, nil, cfg)

	started := time.Now()
	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 2, Retried: 1, Postponed: 3}, res)
	require.Equal(t, int64(1), limitedHits.Load())
	require.Equal(t, int64(2), otherHits.Load())
	require.Equal(t, 1, strings.Count(logged.String(), "outbox destination asked to wait"), logged.String())
	require.Contains(t, logged.String(), "destination=receipts")
	require.Contains(t, logged.String(), "asked=2m0s")
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = ANY($1) AND state = 'pending'
	AND attempts = 0 AND tries = 0 AND unacked_since IS NULL AND next_attempt_at >= $2`, keys[1:4], started.Add(2*time.Minute)),
		"not sent: due after the wait, as if never claimed")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'pending'
	AND attempts = 1 AND next_attempt_at >= $2`, keys[0], started.Add(2*time.Minute)))

	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET next_attempt_at = now() WHERE state = 'pending'`)
	require.NoError(t, err)
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'pending', next_attempt_at = now() WHERE idempotency_key = $1`, keys[5])
	require.NoError(t, err)
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res, "due again by hand, the waiting destination's are left out, the other's is sent")
	require.Equal(t, int64(1), limitedHits.Load())
	require.Equal(t, int64(3), otherHits.Load())

	res, err = b.relay(t, nil, cfg).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Retried: 1, Postponed: 3}, res)
	require.Equal(t, int64(2), limitedHits.Load())
}

// TestRelayConflictsWaitAlone: a Retry-After on a 409 (idemhttp's answer
// for a key still in progress) is the message's wait, not its
// destination's: the batch's other messages are sent.
func TestRelayConflictsWaitAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	conflict, hits := answering(t, http.StatusConflict, "120")
	b.placeN(t, 3)
	started := time.Now()
	res, err := b.relay(t, nil, outbox.RelayConfig{Sender: httpSender(t, conflict.URL), MaxBackoff: time.Hour}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Retried: 3}, res)
	require.Equal(t, int64(3), hits.Load())
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE attempts = 1 AND next_attempt_at >= $1`, started.Add(2*time.Minute)),
		"each waits what its answer asked")
}

// TestRelayDestinationWaitEnds: a destination's wait is at most MaxBackoff,
// whatever it asked for; once it is over, its messages are sent.
func TestRelayDestinationWaitEnds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.placeN(t, 4)
	var sends atomic.Int64
	const maxBackoff = 500 * time.Millisecond
	r := b.relay(t, nil, outbox.RelayConfig{MinBackoff: 10 * time.Millisecond, MaxBackoff: maxBackoff,
		Sender: outbox.SenderFunc(func(context.Context, outbox.Delivery) error {
			if sends.Add(1) == 1 {
				return outbox.RetryAfter(errors.New("rate limited"), time.Hour)
			}
			return nil
		})})
	started := time.Now()
	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Retried: 1, Postponed: 3}, res)
	var latest time.Time
	require.NoError(t, b.schema.Pool.QueryRow(ctx, `SELECT max(next_attempt_at) FROM dedup_outbox`).Scan(&latest))
	require.WithinRange(t, latest, started.Add(maxBackoff-50*time.Millisecond), time.Now().Add(maxBackoff), "an hour asked, MaxBackoff given")

	time.Sleep(time.Until(latest) + 50*time.Millisecond)
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 4}, res)
	require.Equal(t, int64(5), sends.Load())
}

// ExampleRetryAfter: a Sender for an API that says how long to wait.
func ExampleRetryAfter() {
	sender := outbox.SenderFunc(func(ctx context.Context, d outbox.Delivery) error {
		// A client for the destination's API that reports a rate limit.
		if wait, limited := rateLimited(d); limited {
			return outbox.RetryAfter(errors.New("rate limited"), wait)
		}
		return nil
	})
	err := sender.Send(context.Background(), outbox.Delivery{Key: "order-1:receipt", Destination: "mail"})
	fmt.Println(err)
	// Output: rate limited
}

// rateLimited stands for a destination's answer.
func rateLimited(outbox.Delivery) (time.Duration, bool) { return 30 * time.Second, true }

// TestRelayStoppedPassKeepsTheWait: a pass that stops gives its batch back
// unsent; the messages of a destination that asked for a wait go back due
// after it, as postponed ones do, so that another relay, which does not
// know the wait, does not send them meanwhile.
func TestRelayStoppedPassKeepsTheWait(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.placeN(t, 3)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var sends atomic.Int64
	r := b.relay(t, nil, outbox.RelayConfig{MaxBackoff: time.Hour,
		Sender: outbox.SenderFunc(func(context.Context, outbox.Delivery) error {
			sends.Add(1)
			cancel() // the relay stops as the answer comes
			return outbox.RetryAfter(errors.New("rate limited"), 2*time.Minute)
		})})
	started := time.Now()
	_, err := r.RunOnce(ctx)
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, int64(1), sends.Load())
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND attempts = 0
	AND next_attempt_at >= $1`, started.Add(2*time.Minute)), "given back due after the destination's wait")
}
