package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
)

func (b *testBundle) relay(t *testing.T, dest *destination, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	if cfg.Sender == nil {
		cfg.Sender = httpSender(t, dest.URL)
	}
	r, err := outbox.NewRelay(b.ob, cfg)
	require.NoError(t, err)
	return r
}

func (b *testBundle) placeN(t *testing.T, n int) []string {
	t.Helper()
	var keys []string
	for i := range n {
		k, _, err := b.place(t, fmt.Sprintf("o%d", i), []string{"receipt"}, nil)
		require.NoError(t, err)
		keys = append(keys, k...)
	}
	return keys
}

func TestRelayDelivers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	keys := b.placeN(t, 5)
	res, err := b.relay(t, dest, outbox.RelayConfig{BatchSize: 2}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 5}, res)
	for _, k := range keys {
		require.Equal(t, 1, dest.count(k), k)
	}
	require.Equal(t, 5, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent' AND settled_at IS NOT NULL AND attempts = 1`))
	dest.mu.Lock()
	h := dest.headers[0]
	dest.mu.Unlock()
	require.Equal(t, "application/json", h.Get("Content-Type"))
	require.Contains(t, keys, h.Get("Idempotency-Key"))
	require.NotEmpty(t, h.Get("X-Order"), "message headers are sent")

	// Nothing is due any more.
	res, err = b.relay(t, dest, outbox.RelayConfig{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, res)
}

func TestManyRelaysNeverSendOneMessageConcurrently(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	dest.delay = 2 * time.Millisecond
	keys := b.placeN(t, 120)
	var wg sync.WaitGroup
	results := make(chan outbox.RelayResult, 4)
	for range 4 {
		r := b.relay(t, dest, outbox.RelayConfig{BatchSize: 5})
		wg.Go(func() {
			res, err := r.RunOnce(context.Background())
			require.NoError(t, err)
			results <- res
		})
	}
	wg.Wait()
	close(results)
	delivered, relaysThatWorked := 0, 0
	for res := range results {
		delivered += res.Delivered
		if res.Delivered > 0 {
			relaysThatWorked++
		}
	}
	require.Equal(t, 120, delivered)
	require.Greater(t, relaysThatWorked, 1, "the relays shared the work")
	requests, distinct := dest.total()
	require.Equal(t, 120, requests, "each message sent exactly once")
	require.Equal(t, len(keys), distinct)
	require.Zero(t, dest.overlap)
	require.Equal(t, 120, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent' AND attempts = 1`))
}

// TestSlowSendsNeverOverlap: with sends slow enough that a batch outlasts
// its lease, a relay cuts each send at its lease's end and gives back what it
// cannot send in time, so two relays running at once never send one message
// concurrently.
func TestSlowSendsNeverOverlap(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	dest.delay = 100 * time.Millisecond
	keys := b.placeN(t, 8)
	var wg sync.WaitGroup
	for range 2 {
		r := b.relay(t, dest, outbox.RelayConfig{BatchSize: 8, Lease: 600 * time.Millisecond, MinBackoff: 10 * time.Millisecond})
		wg.Go(func() {
			deadline := time.Now().Add(20 * time.Second)
			for time.Now().Before(deadline) && b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state <> 'sent'`) > 0 {
				_, err := r.RunOnce(context.Background())
				assert.NoError(t, err)
			}
		})
	}
	wg.Wait()
	require.Equal(t, 8, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent'`))
	_, distinct := dest.total()
	require.Equal(t, len(keys), distinct)
	require.Zero(t, dest.overlap, "no message was sent by two relays at once")
}

func TestRelayCrashBetweenSendAndAckResendsSameKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	keys := b.placeN(t, 1)
	crashing := b.relay(t, dest, outbox.RelayConfig{Lease: 300 * time.Millisecond})
	outbox.SetAfterSendHook(crashing, func(outbox.Delivery) error { return errors.New("killed") })
	_, err := crashing.RunOnce(context.Background())
	require.ErrorContains(t, err, "killed")
	require.Equal(t, 1, dest.count(keys[0]), "sent once")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sending'`), "not acknowledged")

	other := b.relay(t, dest, outbox.RelayConfig{Lease: 300 * time.Millisecond})
	res, err := other.RunOnce(context.Background())
	require.NoError(t, err)
	require.Zero(t, res, "the lease still holds")

	require.Eventually(t, func() bool {
		res, err := other.RunOnce(context.Background())
		require.NoError(t, err)
		return res.Delivered == 1
	}, 10*time.Second, 50*time.Millisecond)
	require.Equal(t, 2, dest.count(keys[0]), "re-sent after the lease expired, with the same key")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent' AND attempts = 2`))
}

func TestRelayRetriesWithBackoffThenDead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, func(string, int) int { return http.StatusServiceUnavailable })
	keys := b.placeN(t, 1)
	r := b.relay(t, dest, outbox.RelayConfig{MaxAttempts: 3, MinBackoff: 400 * time.Millisecond, MaxBackoff: 800 * time.Millisecond})
	ctx := context.Background()

	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Retried: 1}, res)
	// Backed off: between half and all of MinBackoff from now.
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending'
		AND next_attempt_at > now() + interval '100 ms' AND next_attempt_at <= now() + interval '400 ms'
		AND last_error LIKE '%503%'`))
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, res, "not due during its backoff")

	var last outbox.RelayResult
	require.Eventually(t, func() bool {
		res, err := r.RunOnce(ctx)
		require.NoError(t, err)
		if res != (outbox.RelayResult{}) {
			last = res
		}
		return res.Dead == 1
	}, 10*time.Second, 50*time.Millisecond)
	require.Equal(t, outbox.RelayResult{Dead: 1}, last)
	require.Equal(t, 3, dest.count(keys[0]))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead' AND attempts = 3
		AND last_error LIKE '%503 Service Unavailable%' AND settled_at IS NOT NULL`))
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, res, "dead messages are not sent")
}

// TestBackoffAtHighAttemptsWithAnUncappedMaximum: with MaxBackoff set
// beyond half of time.Duration's range ("no cap"), doubling MinBackoff
// overflowed to a negative wait after some 34 failures, and rand.N
// panicked on it, ending the process that runs the relay (on every relay
// that took the message after). The wait stays capped and positive.
func TestBackoffAtHighAttemptsWithAnUncappedMaximum(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, func(string, int) int { return http.StatusServiceUnavailable })
	b.placeN(t, 1)
	ctx := context.Background()
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET attempts = 34, tries = 34`)
	require.NoError(t, err)
	r := b.relay(t, dest, outbox.RelayConfig{MaxAttempts: 100, MinBackoff: time.Second, MaxBackoff: time.Duration(math.MaxInt64)})
	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Retried: 1}, res)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND tries = 35
		AND next_attempt_at > now() + interval '100 years'`))
}

func TestRelayPermanentFailureIsDeadAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, func(string, int) int { return http.StatusBadRequest })
	b.placeN(t, 1)
	res, err := b.relay(t, dest, outbox.RelayConfig{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Dead: 1}, res)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead' AND attempts = 1 AND last_error LIKE '%400%'`))
}

// TestRowWithUnreadableHeadersFailsAlone: a row another producer wrote,
// whose headers are not an object of strings, goes dead on its own; the
// messages claimed with it are delivered.
func TestRowWithUnreadableHeadersFailsAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	b.placeN(t, 3)
	_, err := b.schema.Pool.Exec(context.Background(), `INSERT INTO dedup_outbox (idempotency_key, event_key, destination, name, headers, payload)
VALUES ('foreign-1', '', 'receipts', 'receipt', '{"a":1}', '{}')`)
	require.NoError(t, err)
	res, err := b.relay(t, dest, outbox.RelayConfig{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 3, Dead: 1}, res)
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = 'foreign-1' AND state = 'dead' AND last_error LIKE '%headers%'`))
	dest.mu.Lock()
	require.Zero(t, dest.received["foreign-1"], "not sent")
	dest.mu.Unlock()
}

// TestSenderPanicIsAFailedSend: a Sender that panics fails that send,
// which is retried and then dead like any other, instead of ending the
// process that runs the relay.
func TestSenderPanicIsAFailedSend(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.placeN(t, 1)
	var logged bytes.Buffer
	r := b.relay(t, nil, outbox.RelayConfig{MaxAttempts: 2, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logged, nil)),
		Sender: outbox.SenderFunc(func(context.Context, outbox.Delivery) error { panic("poison") })})
	ctx := context.Background()
	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Retried: 1}, res)
	require.Eventually(t, func() bool {
		res, err := r.RunOnce(ctx)
		require.NoError(t, err)
		return res.Dead == 1
	}, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead' AND tries = 2 AND stalls = 0 AND NOT in_send
		AND last_error LIKE '%sender panicked: poison%'`), "failed sends, recorded: no stall")
	require.Contains(t, logged.String(), "outbox sender panicked", "with its stack")
}

// TestMessageThatStopsEveryRelayGoesDead: a message whose send stops the
// relay's process before the outcome is recorded (here the Sender ends the
// relay's goroutine, so nothing is released or recorded, as in a crash or
// an out-of-memory kill on that payload) is sent at most MaxAttempts times,
// then made dead without a send, instead of stopping every relay that
// leases it, forever. The messages leased with it, never sent by the
// stopped relay, are delivered: only a send that began counts.
func TestMessageThatStopsEveryRelayGoesDead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	keys := b.placeN(t, 3)
	poison := keys[1]
	ctx := context.Background()
	const lease = 200 * time.Millisecond
	var poisonSends atomic.Int64
	deliver := httpSender(t, dest.URL)
	crashing := outbox.SenderFunc(func(ctx context.Context, d outbox.Delivery) error {
		if d.Key == poison {
			poisonSends.Add(1)
			runtime.Goexit() // the process stops: no outcome, no release
		}
		return deliver.Send(ctx, d)
	})
	for i := range 2 {
		r := b.relay(t, dest, outbox.RelayConfig{Lease: lease, MaxAttempts: 2, BatchSize: 3, Sender: crashing})
		require.Eventually(t, func() bool {
			done := make(chan struct{})
			go func() {
				defer close(done)
				_, _ = r.RunOnce(ctx)
			}()
			<-done
			return poisonSends.Load() == int64(i+1)
		}, 10*time.Second, 20*time.Millisecond, "relay %d reaches the poison message (once its lease expired)", i+1)
	}
	last := b.relay(t, dest, outbox.RelayConfig{Lease: lease, MaxAttempts: 2, BatchSize: 3, Sender: crashing})
	require.Eventually(t, func() bool {
		_, err := last.RunOnce(ctx)
		require.NoError(t, err)
		return b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state IN ('sent', 'dead')`) == 3
	}, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, int64(2), poisonSends.Load(), "not sent a third time")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'dead' AND stalls = 2
		AND last_error LIKE '%2 sends of it in a row began and never recorded an outcome%'`, poison))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent' AND stalls = 0 AND tries = 1 AND NOT in_send`),
		"the others, leased with it, delivered, their leases under the stopped relays not charged")
	for _, k := range []string{keys[0], keys[2]} {
		require.Equal(t, 1, dest.count(k))
	}

	// Re-queued by the reconciler (the destination never saw it), it keeps
	// its stalls: dead again at the next claim, without a send.
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{
		Checker: outbox.CheckerFunc(func(context.Context, outbox.Delivery) (bool, error) { return false, nil })})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Requeued)
	res, err := last.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Dead: 1}, res)
	require.Equal(t, int64(2), poisonSends.Load(), "still not sent a third time")
}

// TestLeaseTakenBeforeTheSendBegins: a message of a batch whose lease
// another relay took over (its lease ran out while the first relay sent the
// one before it) is not sent by the first relay: it is LeaseLost there, and
// the one that took it sends it, once, its try given back.
func TestLeaseTakenBeforeTheSendBegins(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	keys := b.placeN(t, 2)
	ctx := context.Background()
	deliver := httpSender(t, dest.URL)
	var other outbox.RelayResult
	first := b.relay(t, dest, outbox.RelayConfig{Lease: time.Minute, BatchSize: 2, Sender: outbox.SenderFunc(func(ctx context.Context, d outbox.Delivery) error {
		if d.Key == keys[0] {
			// While this send runs, the second message's lease ends and
			// another relay takes it and sends it.
			_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET lease_until = now() - interval '1 second' WHERE idempotency_key = $1`, keys[1])
			require.NoError(t, err)
			second := b.relay(t, dest, outbox.RelayConfig{Lease: time.Minute})
			other, err = second.RunOnce(ctx)
			require.NoError(t, err)
		}
		return deliver.Send(ctx, d)
	})})
	res, err := first.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1, LeaseLost: 1}, res)
	require.Equal(t, outbox.RelayResult{Delivered: 1}, other)
	for _, k := range keys {
		require.Equal(t, 1, dest.count(k), "%s sent once", k)
	}
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent' AND tries = 1 AND stalls = 0 AND NOT in_send`),
		"the lease taken over, under which no send began, is not charged")
}

// TestSlowClaimEndsThePass: when the claim itself takes most of the lease,
// the batch is handed back unsent and the pass ends, instead of claiming
// the same messages again at once, without end.
func TestSlowClaimEndsThePass(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	b.placeN(t, 1)
	ctx := context.Background()
	_, err := b.schema.Pool.Exec(ctx, `CREATE FUNCTION slow_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.state = 'sending' THEN PERFORM pg_sleep(0.09); END IF;
	RETURN NEW;
END $$;
CREATE TRIGGER slow_lease BEFORE UPDATE ON dedup_outbox FOR EACH ROW EXECUTE FUNCTION slow_lease()`)
	require.NoError(t, err)
	r := b.relay(t, dest, outbox.RelayConfig{Lease: 100 * time.Millisecond, BatchSize: 1})
	done := make(chan error, 1)
	go func() {
		_, err := r.RunOnce(ctx)
		done <- err
	}()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("RunOnce kept claiming the message it handed back")
	}
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND tries = 0`), "handed back, its try not counted")
	dest.mu.Lock()
	require.Empty(t, dest.received, "nothing sent")
	dest.mu.Unlock()
}

func TestHTTPSenderClassifiesFailures(t *testing.T) {
	t.Parallel()
	status := map[string]int{"k400": 400, "k404": 404, "k422": 422, "k408": 408, "k409": 409, "k425": 425, "k429": 429, "k500": 500, "k503": 503, "k200": 200, "k201": 201}
	dest := newDestination(t, func(key string, _ int) int { return status[key] })
	s, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{"d": dest.URL}, Timeout: 300 * time.Millisecond})
	require.NoError(t, err)
	ctx := context.Background()
	for key, code := range status {
		err := s.Send(ctx, outbox.Delivery{Key: key, Destination: "d", Payload: []byte(`{}`)})
		switch {
		case code < 300:
			require.NoError(t, err, key)
		case code == 408 || code == 409 || code == 425 || code == 429 || code >= 500:
			var se *outbox.StatusError
			require.ErrorAs(t, err, &se, key)
			require.Equal(t, code, se.StatusCode)
			require.NotErrorIs(t, err, outbox.ErrPermanent, key)
		default:
			require.ErrorIs(t, err, outbox.ErrPermanent, key)
		}
	}

	// A redirect is permanent and not followed, whatever the client given
	// would do: the target, which would answer 200, gets nothing.
	var followed atomic.Int32
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { followed.Add(1) }))
	t.Cleanup(target.Close)
	for _, code := range []int{301, 302, 303, 307, 308} {
		redirect := httptest.NewServer(http.RedirectHandler(target.URL, code))
		t.Cleanup(redirect.Close)
		rs, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{"d": redirect.URL}, Client: &http.Client{}})
		require.NoError(t, err)
		err = rs.Send(ctx, outbox.Delivery{Key: "k", Destination: "d", Payload: []byte(`{}`)})
		var se *outbox.StatusError
		require.ErrorAs(t, err, &se, code)
		require.Equal(t, code, se.StatusCode)
		require.ErrorIs(t, err, outbox.ErrPermanent, code)
	}
	require.Zero(t, followed.Load())

	// A header net/http refuses (in a row some other producer wrote; Enqueue
	// refuses it): permanent, and nothing is sent.
	err = s.Send(ctx, outbox.Delivery{Key: "bad-header", Destination: "d", Payload: []byte(`{}`), Headers: map[string]string{"Bad Name": "v"}})
	require.ErrorIs(t, err, outbox.ErrPermanent)
	dest.mu.Lock()
	require.Zero(t, dest.received["bad-header"])
	dest.mu.Unlock()
	// So is a key the Idempotency-Key header cannot carry as it is (a key
	// of "k " would reach the destination as "k").
	for _, key := range []string{"bad\r\nkey", "bad-key "} {
		err = s.Send(ctx, outbox.Delivery{Key: key, Destination: "d", Payload: []byte(`{}`)})
		require.ErrorIs(t, err, outbox.ErrPermanent, key)
	}
	require.Zero(t, dest.received["bad-key"])

	// Unknown destination: permanent.
	err = s.Send(ctx, outbox.Delivery{Key: "k", Destination: "nowhere"})
	require.ErrorIs(t, err, outbox.ErrPermanent)
	require.ErrorIs(t, err, outbox.ErrUnknownDestination)

	// Network error (nothing listens): retryable.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closedURL := "http://" + ln.Addr().String()
	require.NoError(t, ln.Close())
	down, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{"d": closedURL}})
	require.NoError(t, err)
	err = down.Send(ctx, outbox.Delivery{Key: "k", Destination: "d"})
	require.Error(t, err)
	require.NotErrorIs(t, err, outbox.ErrPermanent)

	// Timeout: retryable.
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	}))
	t.Cleanup(slow.Close)
	ss, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{"d": slow.URL}, Timeout: 100 * time.Millisecond})
	require.NoError(t, err)
	err = ss.Send(ctx, outbox.Delivery{Key: "k", Destination: "d"})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotErrorIs(t, err, outbox.ErrPermanent)

	// The sender keeps its own copy of Endpoints: the caller's map, changed
	// afterwards, changes nothing (and is not read by the sends).
	endpoints := map[string]string{"d": dest.URL}
	cs, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: endpoints})
	require.NoError(t, err)
	endpoints["d"] = closedURL
	require.NoError(t, cs.Send(ctx, outbox.Delivery{Key: "k200", Destination: "d", Payload: []byte(`{}`)}))

	for name, cfg := range map[string]outbox.HTTPSenderConfig{
		"no endpoints": {},
		"bad url":      {Endpoints: map[string]string{"d": "ftp://x"}},
		"bad timeout":  {Endpoints: map[string]string{"d": dest.URL}, Timeout: -1},
	} {
		_, err := outbox.NewHTTPSender(cfg)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, name)
	}
}

// TestHTTPSenderReusesConnections: a destination that answers with a body
// longer than what the sender reads of it (the created resource, a
// replayed answer) is sent every message on one connection: the rest of
// the body is read before it is closed, else net/http cannot reuse the
// connection and every send dials (and shakes hands over TLS) anew.
func TestHTTPSenderReusesConnections(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusCreated, http.StatusServiceUnavailable} {
		srv, conns := longAnswers(t, status)
		s, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{"d": srv.URL}})
		require.NoError(t, err)
		for i := range 10 {
			err := s.Send(context.Background(), outbox.Delivery{Key: fmt.Sprintf("k%d", i), Destination: "d", Payload: []byte(`{}`)})
			if status < 300 {
				require.NoError(t, err)
			} else {
				require.Error(t, err)
			}
		}
		require.LessOrEqual(t, conns.Load(), int32(maxConns), "connections for 10 sends answered %d", status)
	}
}

// TestHTTPCheckerReusesConnections: as the sender, the checker reads a
// long answer's body to its end, so its checks share one connection.
func TestHTTPCheckerReusesConnections(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusOK, http.StatusNotFound, http.StatusServiceUnavailable} {
		srv, conns := longAnswers(t, status)
		c := outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{"d": srv.URL}), Client: srv.Client()}
		for i := range 10 {
			_, _ = c.Applied(context.Background(), outbox.Delivery{Key: fmt.Sprintf("k%d", i), Destination: "d"})
		}
		require.LessOrEqual(t, conns.Load(), int32(maxConns), "connections for 10 checks answered %d", status)
	}
}

// maxConns bounds the connections of 10 requests in the reuse tests: one
// each without reuse. With it, net/http puts a connection back in its idle
// pool from its read loop, after the body's end reached the caller, so the
// next request sometimes dials anew (2 of 10 seen under -count=4).
const maxConns = 3

// longAnswers serves every request with status and an 8 KiB body, and
// counts the connections clients open to it.
func longAnswers(t *testing.T, status int) (srv *httptest.Server, conns *atomic.Int32) {
	t.Helper()
	conns = &atomic.Int32{}
	srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(status)
		_, _ = w.Write(bytes.Repeat([]byte("x"), 8<<10))
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, conns
}

func TestRelayConfigValidate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sender := outbox.SenderFunc(func(context.Context, outbox.Delivery) error { return nil })
	for name, cfg := range map[string]outbox.RelayConfig{
		"sender":  {},
		"batch":   {Sender: sender, BatchSize: -1},
		"lease":   {Sender: sender, Lease: time.Millisecond},
		"backoff": {Sender: sender, MinBackoff: time.Second, MaxBackoff: time.Millisecond},
		"max":     {Sender: sender, MaxAttempts: -2},
		// Not made by NewHTTPSender: a nil one panics at every send, a zero
		// one knows no destination and makes every message dead at once.
		"nil http sender":  {Sender: (*outbox.HTTPSender)(nil)},
		"zero http sender": {Sender: &outbox.HTTPSender{}},
		"nil sender func":  {Sender: outbox.SenderFunc(nil)},
	} {
		_, err := outbox.NewRelay(b.ob, cfg)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, name)
	}
}

func TestRelayRunLoop(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	r := b.relay(t, dest, outbox.RelayConfig{PollInterval: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- r.Run(ctx) }()
	keys := b.placeN(t, 3) // enqueued while the loop polls
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent'`) == 3
	}, 10*time.Second, 20*time.Millisecond)
	cancel()
	require.NoError(t, <-done)
	for _, k := range keys {
		require.Equal(t, 1, dest.count(k))
	}
}

func TestRelayActivity(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	r := b.relay(t, dest, outbox.RelayConfig{})
	b.placeN(t, 3)
	require.Equal(t, outbox.RelayResult{Delivered: 3}, runRelayActivity(t, r))
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent'`))
}

// runRelayActivity runs r's relay activity in a test activity environment
// (its StartToClose is 10 minutes) and returns its result.
func runRelayActivity(t *testing.T, r *outbox.Relay) outbox.RelayResult {
	t.Helper()
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestActivityEnvironment()
	env.RegisterActivityWithOptions(r.Activity, activityNamed(outbox.RelayActivityName(r)))
	val, err := env.ExecuteActivity(outbox.RelayActivityName(r))
	require.NoError(t, err)
	var res outbox.RelayResult
	require.NoError(t, val.Get(&res))
	return res
}

// TestRelayActivityHeartbeatsDuringALongSend: the relay activity heartbeats
// on a clock, not only after each message, so that one send longer than
// the sweeps' HeartbeatTimeout (two minutes; a Lease that allows it) does
// not time the activity out. Here every 50ms, during a send of 1s.
func TestRelayActivityHeartbeatsDuringALongSend(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sending := make(chan struct{})
	dest := newDestination(t, func(string, int) int {
		close(sending)
		time.Sleep(time.Second)
		return http.StatusOK
	})
	b.placeN(t, 1)
	r := b.relay(t, dest, outbox.RelayConfig{})
	outbox.SetRelayHeartbeat(r, 50*time.Millisecond)
	beats, wait := temporaltest.RunActivity(func(env *testsuite.TestActivityEnvironment) {
		env.RegisterActivityWithOptions(r.Activity, activityNamed(outbox.RelayActivityName(r)))
	}, outbox.RelayActivityName(r))
	<-sending
	before := beats.Count()
	time.Sleep(700 * time.Millisecond)
	during := beats.Count() - before
	var res outbox.RelayResult
	require.NoError(t, wait(&res))
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res)
	require.GreaterOrEqual(t, during, int64(5), "heartbeats while one send took 1s (every 50ms)")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent'`))
}

// TestReconcileActivityHeartbeatsDuringALongCheck: the reconcile activity
// heartbeats on a clock when its checks are bounded (an HTTPChecker's
// Timeout, which may be longer than the sweeps' two-minute
// HeartbeatTimeout), not only before each check. Here every 50ms, during
// a check of 1s.
func TestReconcileActivityHeartbeatsDuringALongCheck(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	b.placeN(t, 1)
	// Sent long ago, its answer lost; its lease over.
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'sending', attempts = 1, tries = 1, in_send = true,
	unacked_since = now() - interval '10 minutes', lease_until = now() - interval '1 second'`)
	require.NoError(t, err)
	checking := make(chan struct{})
	status := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(checking)
		time.Sleep(time.Second)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"applied":true}`)
	}))
	t.Cleanup(status.Close)
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{
		Checker: outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{"receipts": status.URL})}})
	require.NoError(t, err)
	outbox.SetReconcileHeartbeat(rc, 50*time.Millisecond)
	beats, wait := temporaltest.RunActivity(func(env *testsuite.TestActivityEnvironment) {
		env.RegisterActivityWithOptions(outbox.ReconcileActivity(rc), activityNamed(outbox.ReconcileActivityName(rc)))
	}, outbox.ReconcileActivityName(rc))
	<-checking
	before := beats.Count()
	time.Sleep(700 * time.Millisecond)
	during := beats.Count() - before
	var rep outbox.ReconcileReport
	require.NoError(t, wait(&rep))
	require.Equal(t, 1, rep.Checked)
	require.GreaterOrEqual(t, during, int64(5), "heartbeats while one check took 1s (every 50ms)")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'applied'`))
}

// TestRelayActivityEndsBeforeItsDeadline: a pass whose next batch's lease
// would end within a minute of the activity's deadline (the test
// environment's StartToClose is 10 minutes) claims nothing more and returns
// with OutOfTime, the messages left for the next run, instead of running
// into the timeout: a timed-out run is retried and, a backlog later, fails.
func TestRelayActivityEndsBeforeItsDeadline(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	b.placeN(t, 3)
	run := func(lease time.Duration) outbox.RelayResult {
		return runRelayActivity(t, b.relay(t, dest, outbox.RelayConfig{Lease: lease}))
	}
	require.Equal(t, outbox.RelayResult{OutOfTime: true}, run(9*time.Minute+30*time.Second), "a lease past the deadline's last minute")
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND attempts = 0`), "left as they were")
	require.Equal(t, outbox.RelayResult{Delivered: 3}, run(8*time.Minute), "a lease that ends before it")
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent'`))
}

func TestRelayWorkflowRunsTheActivity(t *testing.T) {
	t.Parallel()
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestWorkflowEnvironment()
	env.RegisterWorkflow(outbox.RelayWorkflow)
	env.RegisterActivityWithOptions(func(context.Context) (outbox.RelayResult, error) {
		return outbox.RelayResult{Delivered: 7}, nil
	}, activityNamed("DedupOutboxRelay:x"))
	env.ExecuteWorkflow(outbox.RelayWorkflow, "DedupOutboxRelay:x")
	require.NoError(t, env.GetWorkflowError())
	var res outbox.RelayResult
	require.NoError(t, env.GetWorkflowResult(&res))
	require.Equal(t, 7, res.Delivered)
}

// TestOutboxesShareAWorker: one worker registers the relays and
// reconcilers of two outboxes, and the relay workflow runs the relay of the
// outbox whose activity it is given.
func TestOutboxesShareAWorker(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	ob2, err := outbox.New(b.schema.Pool, outbox.Options{Table: "dedup_outbox_2"})
	require.NoError(t, err)
	require.NoError(t, ob2.Migrate(context.Background()))
	r1 := b.relay(t, dest, outbox.RelayConfig{})
	r2, err := outbox.NewRelay(ob2, outbox.RelayConfig{Sender: httpSender(t, dest.URL)})
	require.NoError(t, err)
	checker := outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{"receipts": dest.URL + "/idempotency-keys"})}
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestWorkflowEnvironment()
	for _, ob := range []*outbox.Outbox{b.ob, ob2} {
		rc, err := outbox.NewReconciler(ob, outbox.ReconcilerConfig{Checker: checker})
		require.NoError(t, err)
		outbox.RegisterReconciler(env, rc)
	}
	outbox.RegisterRelay(env, r1)
	outbox.RegisterRelay(env, r2)

	b.placeN(t, 2)
	env.ExecuteWorkflow("DedupOutboxRelay", outbox.RelayActivityName(r1))
	require.NoError(t, env.GetWorkflowError())
	var res outbox.RelayResult
	require.NoError(t, env.GetWorkflowResult(&res))
	require.Equal(t, outbox.RelayResult{Delivered: 2}, res)
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent'`))
}

// httpSender sends the "receipts" destination's messages to url.
func httpSender(t *testing.T, url string) outbox.Sender {
	t.Helper()
	s, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{"receipts": url}, Timeout: 2 * time.Second})
	require.NoError(t, err)
	return s
}

// TestTableLabelNamesTheSchema: outboxes on tables of one name in two
// schemas report their backlog under two dedup.outbox.table values.
func TestTableLabelNamesTheSchema(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	var want []string
	for _, schema := range []string{s.Name + "_a", s.Name + "_b"} {
		t.Cleanup(func() { _, _ = pgtestDrop(s, schema) })
		ob, err := outbox.New(s.Pool, outbox.Options{Schema: schema, Table: "box", MeterProvider: mp})
		require.NoError(t, err)
		require.NoError(t, ob.Migrate(ctx))
		want = append(want, schema+".box")
		require.Equal(t, "DedupOutboxPrune:"+schema+".box", outbox.PruneActivityName(ob), "the activity names carry the same name, unquoted")
	}
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	var got []string
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == outbox.MetricOldestPendingAge {
				for _, dp := range m.Data.(metricdata.Gauge[float64]).DataPoints {
					tbl, _ := dp.Attributes.Value(outbox.TableKey)
					got = append(got, tbl.AsString())
				}
			}
		}
	}
	require.ElementsMatch(t, want, got)
}

// TestUnrecordedOutcomeCountsAsStopped: a send whose outcome the relay
// could not record (the outbox's table unreachable once the destination
// answered) is counted as stopped, as the pass stops there: not as the
// delivered, retried or dead it would have been, which the table does not
// say (the message is still leased, sent again after its lease).
func TestUnrecordedOutcomeCountsAsStopped(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for status, would := range map[int]string{200: "delivered", 503: "retried", 400: "dead"} {
		t.Run(would, func(t *testing.T) {
			table := fmt.Sprintf("dedup_outbox_%d", status)
			ob, err := outbox.New(b.schema.Pool, outbox.Options{Table: table})
			require.NoError(t, err)
			require.NoError(t, ob.Migrate(ctx))
			require.NoError(t, pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
				_, err := ob.Enqueue(ctx, tx, outbox.Message{Destination: "receipts", Key: "k-" + would, Payload: []byte(`{}`)})
				return err
			}))
			dest := newDestination(t, func(string, int) int {
				// The table goes away while the destination answers.
				_, err := b.schema.Pool.Exec(ctx, `ALTER TABLE `+table+` RENAME TO `+table+`_away`)
				require.NoError(t, err)
				return status
			})
			reader := sdkmetric.NewManualReader()
			r, err := outbox.NewRelay(ob, outbox.RelayConfig{Sender: httpSender(t, dest.URL), MaxAttempts: 5,
				MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
			require.NoError(t, err)
			_, err = r.RunOnce(ctx)
			require.Error(t, err)
			_, err = b.schema.Pool.Exec(ctx, `ALTER TABLE `+table+`_away RENAME TO `+table)
			require.NoError(t, err)

			counts, _, _ := relayMetrics(t, reader)
			require.Equal(t, int64(1), counts["receipts/stopped"], "%v", counts)
			require.Zero(t, counts["receipts/"+would], "%v", counts)
			require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+table+` WHERE state = 'sending'`), "still leased")
		})
	}
}

func TestRelayTelemetry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	spans := tracetest.NewSpanRecorder()
	reader := sdkmetric.NewManualReader()
	fail := map[string]int{} // key -> status
	var mu sync.Mutex
	dest.respond = func(key string, _ int) int {
		mu.Lock()
		defer mu.Unlock()
		if s, ok := fail[key]; ok {
			return s
		}
		return http.StatusOK
	}
	keys := b.placeN(t, 3)
	mu.Lock()
	fail[keys[1]] = 503
	fail[keys[2]] = 400
	mu.Unlock()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	var err error
	b.ob, err = outbox.New(b.schema.Pool, outbox.Options{MeterProvider: mp}) // the backlog gauges are the outbox's
	require.NoError(t, err)
	r := b.relay(t, dest, outbox.RelayConfig{
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)),
		MeterProvider:  mp,
	})
	// Before any send, the series of the HTTPSender's destination are
	// there at zero (RelayConfig.Destinations' default), so the first dead
	// letter shows in increase().
	counts, _, _ := relayMetrics(t, reader)
	require.Equal(t, map[string]int64{"receipts/delivered": 0, "receipts/retried": 0, "receipts/dead": 0, "receipts/lease_lost": 0, "receipts/stopped": 0}, counts)
	res, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1, Retried: 1, Dead: 1}, res)

	results := map[string]string{}
	for _, s := range spans.Ended() {
		require.Equal(t, "OutboxSend:receipts", s.Name())
		attrs := attribute.NewSet(s.Attributes()...)
		k, _ := attrs.Value(outbox.MessageKeyKey)
		v, _ := attrs.Value(outbox.ResultKey)
		results[k.AsString()] = v.AsString()
	}
	require.Equal(t, map[string]string{keys[0]: "delivered", keys[1]: "retried", keys[2]: "dead"}, results)

	counts, oldest, messages := relayMetrics(t, reader)
	require.Equal(t, map[string]int64{"receipts/delivered": 1, "receipts/retried": 1, "receipts/dead": 1, "receipts/lease_lost": 0, "receipts/stopped": 0}, counts)
	require.Greater(t, oldest, 0.0, "the retried message is still pending")
	require.Equal(t, map[string]int64{"dedup_outbox/pending": 1, "dedup_outbox/sending": 0, "dedup_outbox/dead": 1}, messages)

	// The gauges are read at each collection: once the retried message is
	// delivered, the next collection says so.
	mu.Lock()
	delete(fail, keys[1])
	mu.Unlock()
	_, err = b.schema.Pool.Exec(context.Background(), `UPDATE dedup_outbox SET next_attempt_at = now() WHERE state = 'pending'`)
	require.NoError(t, err)
	res, err = r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res)
	_, oldest, messages = relayMetrics(t, reader)
	require.Zero(t, oldest, "nothing waits for the relay")
	require.Equal(t, map[string]int64{"dedup_outbox/pending": 0, "dedup_outbox/sending": 0, "dedup_outbox/dead": 1}, messages)
}

// relayMetrics collects reader: sends by "destination/result", the oldest
// pending age (-1 if not observed) and waiting messages by "table/state".
func relayMetrics(t *testing.T, reader *sdkmetric.ManualReader) (counts map[string]int64, oldest float64, messages map[string]int64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	counts, oldest, messages = map[string]int64{}, -1, map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch m.Name {
			case outbox.MetricDeliveries:
				for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
					res, _ := dp.Attributes.Value(outbox.ResultKey)
					dst, _ := dp.Attributes.Value(outbox.DestinationKey)
					counts[dst.AsString()+"/"+res.AsString()] += dp.Value
				}
			case outbox.MetricOldestPendingAge:
				oldest = m.Data.(metricdata.Gauge[float64]).DataPoints[0].Value
			case outbox.MetricMessages:
				for _, dp := range m.Data.(metricdata.Gauge[int64]).DataPoints {
					st, _ := dp.Attributes.Value(outbox.StateKey)
					table, _ := dp.Attributes.Value(outbox.TableKey)
					messages[table.AsString()+"/"+st.AsString()] = dp.Value
				}
			}
		}
	}
	return counts, oldest, messages
}

func activityNamed(name string) activity.RegisterOptions { return activity.RegisterOptions{Name: name} }

// TestRelayStoppingGivesTheMessageBack: a relay stopped during a send (its
// context cancelled) gives the message back without counting the try, so a
// shutdown on the last try does not make a dead letter.
func TestRelayStoppingGivesTheMessageBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	dest.delay = time.Second
	b.placeN(t, 1)
	r := b.relay(t, dest, outbox.RelayConfig{MaxAttempts: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := r.RunOnce(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND tries = 0 AND attempts = 0
		AND NOT in_send`), "given back, the send that began cleared: no stall at the next claim")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE unacked_since IS NOT NULL`),
		"unacknowledged since the send began: it may have reached the destination")
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

// TestMaxAttemptsBoundsFailedSendsNotAllSends pins RelayConfig.MaxAttempts:
// it counts the sends that failed and those that stalled (began and
// recorded no outcome, their lease taken over), and makes the message dead
// at the failure that brings that count to MaxAttempts or past it; a send
// cut off by a stopping relay (given back) is not counted. So, with
// MaxAttempts 2, a message given back once, then failing, stalling and
// failing, is sent four times and made dead at its second failure; with
// MaxAttempts 3, failing, stalling and failing makes it dead at its second
// failure, the stall counted; with MaxAttempts 2, failing and stalling
// twice, it is sent three times and made dead, unsent, at the next claim.
// The Sender counts the sends; the row is read by SQL.
func TestMaxAttemptsBoundsFailedSendsNotAllSends(t *testing.T) {
	t.Parallel()
	const (
		givenBack = "given back"
		fails     = "fails"
		stalls    = "stalls"
	)
	for _, c := range []struct {
		maxAttempts int
		script      []string
	}{
		{2, []string{givenBack, fails, stalls, fails}},
		{3, []string{fails, stalls, fails}},
		{2, []string{fails, stalls, stalls}}, // 2 x MaxAttempts - 1 sends; the next claim makes it dead unsent
	} {
		b := setup(t)
		b.placeN(t, 1)
		var sends atomic.Int64
		sending := make(chan struct{}, 1)
		sender := outbox.SenderFunc(func(ctx context.Context, d outbox.Delivery) error {
			n := sends.Add(1)
			switch c.script[n-1] {
			case givenBack:
				sending <- struct{}{}
				<-ctx.Done()
				return ctx.Err()
			case stalls:
				runtime.Goexit() // the process stops: no outcome, no release
			}
			return fmt.Errorf("send %d refused", n)
		})
		r := b.relay(t, nil, outbox.RelayConfig{Sender: sender, MaxAttempts: c.maxAttempts, Lease: 200 * time.Millisecond,
			MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond})
		run := func(ctx context.Context) (res outbox.RelayResult, err error) {
			done := make(chan struct{})
			go func() {
				defer close(done)
				res, err = r.RunOnce(ctx)
			}()
			<-done
			return res, err
		}
		var res outbox.RelayResult
		for i, step := range c.script {
			switch step {
			case givenBack:
				ctx, cancel := context.WithCancel(context.Background())
				go func() { <-sending; cancel() }()
				_, err := run(ctx)
				require.ErrorIs(t, err, context.Canceled)
				require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND tries = 0 AND NOT in_send`),
					"%v: given back, its try not counted", c.script)
			case stalls:
				require.Eventually(t, func() bool { // once due, after the backoff
					_, _ = run(context.Background())
					return sends.Load() == int64(i+1)
				}, 10*time.Second, 10*time.Millisecond)
				require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sending' AND in_send`), "%v: stalled", c.script)
			case fails:
				require.Eventually(t, func() bool { // once due: after the backoff, or the stalled send's lease
					var err error
					res, err = run(context.Background())
					require.NoError(t, err)
					return res != (outbox.RelayResult{})
				}, 10*time.Second, 10*time.Millisecond)
				require.Equal(t, int64(i+1), sends.Load(), "%v: sent", c.script)
			}
		}
		lastError := fmt.Sprintf("%%send %d refused%%", len(c.script))
		if c.script[len(c.script)-1] == stalls {
			require.Eventually(t, func() bool { // once the stalled send's lease is over
				var err error
				res, err = run(context.Background())
				require.NoError(t, err)
				return res != (outbox.RelayResult{})
			}, 10*time.Second, 10*time.Millisecond)
			lastError = "%2 sends of it in a row began and never recorded an outcome%"
		}
		require.Equal(t, outbox.RelayResult{Dead: 1}, res, "%v: dead", c.script)
		require.Equal(t, int64(len(c.script)), sends.Load(), "%v: not sent again", c.script)
		require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead' AND last_error LIKE $1`, lastError),
			"%v: made dead by %s", c.script, lastError)
	}
}
