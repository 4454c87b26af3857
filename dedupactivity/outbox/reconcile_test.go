package outbox_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/dedupactivity/idemhttp"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

// receiver is a destination service on loopback with its own database
// schema: POST /receipts behind the idemhttp middleware inserts a row;
// GET /idempotency-keys/{key} answers whether a key was applied.
type receiver struct {
	*httptest.Server
	schema *pgtest.Schema
	// dropResponse, when set, closes the connection after the handler
	// committed, so the sender never sees the response.
	dropResponse atomic.Bool
	// down, when set, answers 503 without running anything.
	down atomic.Bool
	// reject, when set, makes the handler refuse the request with 422
	// (final: the middleware stores and replays it) and write nothing.
	reject atomic.Bool
}

func newReceiver(t *testing.T) *receiver {
	t.Helper()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	m, err := idemhttp.New(s.Pool, idemhttp.Options{RequireKey: true})
	require.NoError(t, err)
	require.NoError(t, m.Migrate(ctx))
	_, err = s.Pool.Exec(ctx, `CREATE TABLE receipt (id bigserial PRIMARY KEY, idempotency_key text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)
	rv := &receiver{schema: s}
	mux := http.NewServeMux()
	receipts := m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if rv.reject.Load() {
			http.Error(w, "no such account", http.StatusUnprocessableEntity)
			return
		}
		tx, _ := idemhttp.Tx(r.Context())
		body, _ := io.ReadAll(r.Body)
		if _, err := tx.Exec(r.Context(), `INSERT INTO receipt (idempotency_key, body) VALUES ($1, $2)`, r.Header.Get("Idempotency-Key"), string(body)); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	mux.HandleFunc("POST /receipts", func(w http.ResponseWriter, r *http.Request) {
		if rv.down.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		if !rv.dropResponse.Load() {
			receipts.ServeHTTP(w, r)
			return
		}
		receipts.ServeHTTP(httptest.NewRecorder(), r) // committed; the response is lost
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close()
		}
	})
	mux.Handle("GET /idempotency-keys/{key}", m.StatusHandler())
	rv.Server = httptest.NewServer(mux)
	t.Cleanup(rv.Close)
	return rv
}

// applied counts receipts at the destination, by SQL.
func (rv *receiver) applied(t *testing.T, key string) int {
	t.Helper()
	var n int
	require.NoError(t, rv.schema.Pool.QueryRow(context.Background(), `SELECT count(*) FROM receipt WHERE idempotency_key = $1`, key).Scan(&n))
	return n
}

func (rv *receiver) checker() outbox.Checker {
	return outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{"receipts": rv.URL + "/idempotency-keys"})}
}

func (b *testBundle) relayTo(t *testing.T, url string, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	s, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{"receipts": url}, Timeout: 2 * time.Second})
	require.NoError(t, err)
	cfg.Sender = s
	r, err := outbox.NewRelay(b.ob, cfg)
	require.NoError(t, err)
	return r
}

func TestResendIsAppliedOnceAtDestination(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	keys := b.placeN(t, 1)
	// Relay A sends and dies before acknowledging; relay B re-sends after
	// the lease, with the same key.
	a := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{Lease: 200 * time.Millisecond})
	outbox.SetAfterSendHook(a, func(outbox.Delivery) error { return errors.New("killed") })
	_, err := a.RunOnce(context.Background())
	require.Error(t, err)
	require.Equal(t, 1, rv.applied(t, keys[0]))
	relayB := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{Lease: 200 * time.Millisecond})
	require.Eventually(t, func() bool {
		res, err := relayB.RunOnce(context.Background())
		require.NoError(t, err)
		return res.Delivered == 1
	}, 10*time.Second, 50*time.Millisecond)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent' AND attempts = 2`))
	require.Equal(t, 1, rv.applied(t, keys[0]), "sent twice, applied once")
}

func TestReconcilerMarksAppliedWhenResponsesAreLost(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	rv.dropResponse.Store(true)
	keys := b.placeN(t, 2)
	r := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{MinBackoff: time.Hour, MaxBackoff: time.Hour})
	res, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Retried: 2}, res, "the sender saw network errors")
	for _, k := range keys {
		require.Equal(t, 1, rv.applied(t, k), "but the destination committed")
	}

	spans := tracetest.NewSpanRecorder()
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), UnackedAfter: time.Millisecond,
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))})
	require.NoError(t, err)
	time.Sleep(5 * time.Millisecond) // past UnackedAfter
	rep, err := rc.Reconcile(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.ReconcileReport{Checked: 2, Applied: 2}, rep)
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'applied' AND settled_at IS NOT NULL`))
	require.Len(t, spans.Ended(), 1)
	attrs := attribute.NewSet(spans.Ended()[0].Attributes()...)
	v, _ := attrs.Value("dedup.outbox.reconcile.applied")
	require.Equal(t, int64(2), v.AsInt64())

	// Settled: nothing to check any more, nothing to send.
	rep, err = rc.Reconcile(context.Background())
	require.NoError(t, err)
	require.Zero(t, rep.Checked)
}

func TestReconcilerLeavesRecentlySentMessagesAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	rv.dropResponse.Store(true)
	b.placeN(t, 1)
	_, err := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{MinBackoff: time.Hour, MaxBackoff: time.Hour}).RunOnce(context.Background())
	require.NoError(t, err)
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), UnackedAfter: time.Hour})
	require.NoError(t, err)
	rep, err := rc.Reconcile(context.Background())
	require.NoError(t, err)
	require.Zero(t, rep.Checked, "unacknowledged for less than UnackedAfter")
}

func TestReconcilerRequeuesDeadLettersNotApplied(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	rv.down.Store(true)
	keys := b.placeN(t, 1)
	r := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{MaxAttempts: 1})
	res, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Dead: 1}, res)

	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), MaxRequeues: 1})
	require.NoError(t, err)
	rv.down.Store(false) // the destination is back
	rep, err := rc.Reconcile(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.ReconcileReport{Checked: 1, Requeued: 1}, rep)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND requeues = 1 AND tries = 0`))
	res, err = r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res, "a fresh attempt budget")
	require.Equal(t, 1, rv.applied(t, keys[0]))

	// A dead letter past MaxRequeues is reported, not re-queued.
	keys2, _, err := b.place(t, "later", []string{"receipt"}, nil)
	require.NoError(t, err)
	rv.down.Store(true)
	for range 2 {
		require.Eventually(t, func() bool {
			res, err := r.RunOnce(context.Background())
			require.NoError(t, err)
			return res.Dead == 1
		}, 5*time.Second, 10*time.Millisecond)
		rep, err = rc.Reconcile(context.Background())
		require.NoError(t, err)
	}
	require.Equal(t, 1, rep.Checked)
	require.Len(t, rep.Unresolved, 1)
	require.Equal(t, keys2[0], rep.Unresolved[0].Key)
	require.Equal(t, outbox.StateDead, rep.Unresolved[0].State)
	require.Contains(t, rep.Unresolved[0].Reason, "re-queues")
	require.Contains(t, rep.Unresolved[0].LastError, "503")
}

// TestReconcilerDoesNotCallRejectedApplied: the destination committed a
// final 422 for a message (stored and replayed by idemhttp). That message
// was not applied, and sending it again gets the same 422: the reconciler
// makes it dead, or leaves it dead, and reports it; it is never marked
// applied, nor re-queued.
func TestReconcilerDoesNotCallRejectedApplied(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	rv.reject.Store(true)
	keys := b.placeN(t, 2)
	r := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{MinBackoff: time.Hour, MaxBackoff: time.Hour})

	// keys[0]: the relay sees the 422 and makes it dead at once. keys[1]:
	// its 422 is lost on the way back, so it stays pending, unacknowledged.
	_, err := b.schema.Pool.Exec(context.Background(), `UPDATE dedup_outbox SET next_attempt_at = now() + interval '1 hour' WHERE idempotency_key = $1`, keys[1])
	require.NoError(t, err)
	res, err := r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Dead: 1}, res)
	_, err = b.schema.Pool.Exec(context.Background(), `UPDATE dedup_outbox SET next_attempt_at = now() WHERE idempotency_key = $1`, keys[1])
	require.NoError(t, err)
	rv.dropResponse.Store(true)
	res, err = r.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Retried: 1}, res)
	for _, k := range keys {
		require.Zero(t, rv.applied(t, k))
	}

	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), UnackedAfter: time.Millisecond})
	require.NoError(t, err)
	time.Sleep(5 * time.Millisecond) // past UnackedAfter
	rep, err := rc.Reconcile(context.Background())
	require.NoError(t, err)
	require.Equal(t, 2, rep.Checked)
	require.Zero(t, rep.Applied)
	require.Zero(t, rep.Requeued)
	require.Len(t, rep.Unresolved, 2)
	for _, u := range rep.Unresolved {
		require.Equal(t, outbox.StateDead, u.State, u.Key)
		require.Contains(t, u.Reason, "422", u.Key)
	}
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead' AND settled_at IS NOT NULL`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND last_error LIKE '%rejected%422%'`, keys[1]),
		"the unacknowledged one is dead with the destination's answer")

	// Asked again, both stay dead and reported: no re-queue budget is spent.
	rep, err = rc.Reconcile(context.Background())
	require.NoError(t, err)
	require.Len(t, rep.Unresolved, 2)
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead' AND requeues = 0`))
}

func TestReconcilerReportsWhatItCannotAsk(t *testing.T) {
	t.Parallel()
	b := setup(t)
	keys := b.placeN(t, 1)
	_, err := b.schema.Pool.Exec(context.Background(), `UPDATE dedup_outbox SET state = 'dead', attempts = 3, last_error = 'x'`)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	downURL := "http://" + ln.Addr().String()
	require.NoError(t, ln.Close())
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{
		Checker: outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{"receipts": downURL})}})
	require.NoError(t, err)
	rep, err := rc.Reconcile(context.Background())
	require.NoError(t, err)
	require.Len(t, rep.Unresolved, 1)
	require.Equal(t, keys[0], rep.Unresolved[0].Key)
	require.Contains(t, rep.Unresolved[0].Reason, "unknown")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead' AND attempts = 3`), "left as it was")

	_, err = outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

func TestReconcileActivity(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	rv.down.Store(true)
	b.placeN(t, 1)
	_, err := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{MaxAttempts: 1}).RunOnce(context.Background())
	require.NoError(t, err)
	rv.down.Store(false)
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker()})
	require.NoError(t, err)
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestActivityEnvironment()
	env.RegisterActivityWithOptions(rc.Reconcile, activityNamed(outbox.ReconcileActivityName(rc)))
	val, err := env.ExecuteActivity(outbox.ReconcileActivityName(rc))
	require.NoError(t, err)
	var rep outbox.ReconcileReport
	require.NoError(t, val.Get(&rep))
	require.Equal(t, outbox.ReconcileReport{Checked: 1, Requeued: 1}, rep)
}

// TestReconcilerSpentDeadLettersComeLast: dead letters out of re-queues
// (reported on every run) do not crowd out a message the run can still
// settle.
func TestReconcilerSpentDeadLettersComeLast(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	keys := b.placeN(t, 3)
	ctx := context.Background()
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'dead', requeues = 5 WHERE idempotency_key = ANY($1)`, keys[:2])
	require.NoError(t, err)
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET unacked_since = now() - interval '1 hour' WHERE idempotency_key = $1`, keys[2])
	require.NoError(t, err)

	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), MaxRequeues: 1, MaxMessages: 1})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.ReconcileReport{Checked: 1, Requeued: 1}, rep, "the unacknowledged message, not a spent dead letter")
}
