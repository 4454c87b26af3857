package outbox_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/testsuite"
	"google.golang.org/protobuf/proto"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
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

// deadLetters places n messages and makes them dead, for a reconciler to
// ask about; it returns their keys.
func (b *testBundle) deadLetters(t *testing.T, n int) []string {
	t.Helper()
	keys := b.placeN(t, n)
	_, err := b.schema.Pool.Exec(context.Background(), `UPDATE dedup_outbox SET state = 'dead'`)
	require.NoError(t, err)
	return keys
}

func (b *testBundle) relayTo(t *testing.T, url string, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	cfg.Sender = httpSender(t, url)
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

	// MaxRequeues -1: none, a fresh dead letter is reported at once (0 is
	// the default, and -2 is refused).
	keys3, _, err := b.place(t, "never", []string{"receipt"}, nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		res, err := r.RunOnce(context.Background())
		require.NoError(t, err)
		return res.Dead == 1
	}, 5*time.Second, 10*time.Millisecond)
	none, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), MaxRequeues: -1})
	require.NoError(t, err)
	rep, err = none.Reconcile(context.Background())
	require.NoError(t, err)
	require.Zero(t, rep.Requeued)
	var reported []string
	for _, u := range rep.Unresolved {
		reported = append(reported, u.Key)
	}
	require.Contains(t, reported, keys3[0])
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'dead' AND requeues = 0`, keys3[0]))
	_, err = outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), MaxRequeues: -2})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

// sentAndForgotten places one message and has a relay of cfg send it to
// rv, which applies it and loses the response (the pass's result is want).
// Then it is 25 hours later: the destination's key expired and was pruned,
// and the message, enqueued and first sent 25 hours ago, is due. It returns
// the message's key and the relay.
func sentAndForgotten(t *testing.T, b *testBundle, rv *receiver, cfg outbox.RelayConfig, want outbox.RelayResult) (string, *outbox.Relay) {
	t.Helper()
	ctx := context.Background()
	rv.dropResponse.Store(true)
	keys := b.placeN(t, 1)
	r := b.relayTo(t, rv.URL+"/receipts", cfg)
	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, want, res)
	require.Equal(t, 1, rv.applied(t, keys[0]), "applied at the destination, its response lost")

	_, err = rv.schema.Pool.Exec(ctx, `UPDATE dedup_marker SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	d, err := dedupactivity.New(rv.schema.Pool, dedupactivity.Options{})
	require.NoError(t, err)
	n, err := d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET created_at = created_at - interval '25 hours',
	unacked_since = unacked_since - interval '25 hours', next_attempt_at = now()`)
	require.NoError(t, err)
	rv.dropResponse.Store(false)
	return keys[0], r
}

// TestReconcilerLeavesOldDeadLettersToAPerson: a message the destination
// applied, its response lost, then dead longer than the destination keeps
// keys. The destination pruned the key and answers 404, "not applied": a
// re-send would apply it again. The reconciler reports it instead of
// re-queuing it; with a KeyRetention longer than the message's age it is
// re-queued as any dead letter not applied.
func TestReconcilerLeavesOldDeadLettersToAPerson(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	rv := newReceiver(t)
	key, r := sentAndForgotten(t, b, rv, outbox.RelayConfig{MaxAttempts: 1}, outbox.RelayResult{Dead: 1})

	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker()})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Checked)
	require.Zero(t, rep.Requeued)
	require.Len(t, rep.Unresolved, 1)
	require.Equal(t, key, rep.Unresolved[0].Key)
	require.Contains(t, rep.Unresolved[0].Reason, "KeyRetention (23h0m0s)")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead' AND requeues = 0`))
	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{}, res, "nothing to send")
	require.Equal(t, 1, rv.applied(t, key), "applied once")

	longer, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), KeyRetention: 26 * time.Hour})
	require.NoError(t, err)
	rep, err = longer.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.ReconcileReport{Checked: 1, Requeued: 1}, rep, "younger than its KeyRetention: re-queued")

	for _, bad := range []time.Duration{-time.Hour, time.Millisecond} {
		_, err = outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), KeyRetention: bad})
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, bad)
	}
}

// TestRelaySendsNothingOlderThanTheDestinationsKeys: a message the
// destination applied, its response lost, then not sent again for longer
// than the destination keeps keys (the relays were down for a day). The
// destination pruned the key: a re-send would apply it again. The relay
// makes it dead instead, and the reconciler reports it; a message never
// sent is sent whatever its age.
func TestRelaySendsNothingOlderThanTheDestinationsKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	rv := newReceiver(t)
	key, r := sentAndForgotten(t, b, rv, outbox.RelayConfig{}, outbox.RelayResult{Retried: 1})
	unsent, _, err := b.place(t, "late", []string{"receipt"}, nil)
	require.NoError(t, err)
	require.Len(t, unsent, 1)
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET created_at = created_at - interval '25 hours' WHERE idempotency_key = $1`, unsent[0])
	require.NoError(t, err)

	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1, Dead: 1}, res)
	require.Equal(t, 1, rv.applied(t, key), "not sent again: applied once")
	require.Equal(t, 1, rv.applied(t, unsent[0]), "never sent before: sent")
	// attempts = 2: the claim that made it dead counts, as a stalled one's does.
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'dead' AND attempts = 2
	AND last_error LIKE '%first sent 25h0m_s ago and not acknowledged since%(KeyRetention 23h0m0s)%'`, key))

	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker()})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Len(t, rep.Unresolved, 1, "left to a person")
	require.Equal(t, key, rep.Unresolved[0].Key)
	require.Zero(t, rep.Requeued)

	for _, bad := range []time.Duration{-time.Hour, time.Millisecond} {
		_, err = outbox.NewRelay(b.ob, outbox.RelayConfig{Sender: httpSender(t, rv.URL), KeyRetention: bad})
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, bad)
	}
}

// TestReconcilerRequeuesNothingOlderThanTheDestinationsKeys: as
// TestRelaySendsNothingOlderThanTheDestinationsKeys, but the reconciler
// reaches the unacknowledged message before a relay does. The destination,
// which pruned the key, answers "not applied": the message is reported, not
// re-queued with a fresh unacknowledged time that a relay would send.
// (Found by a review.)
func TestReconcilerRequeuesNothingOlderThanTheDestinationsKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	rv := newReceiver(t)
	key, r := sentAndForgotten(t, b, rv, outbox.RelayConfig{}, outbox.RelayResult{Retried: 1})

	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker()})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, rep.Requeued)
	require.Len(t, rep.Unresolved, 1)
	require.Contains(t, rep.Unresolved[0].Reason, "first sent more than KeyRetention (23h0m0s) ago")

	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Dead: 1}, res)
	require.Equal(t, 1, rv.applied(t, key), "applied once")
}

// TestRelaySendsAMessageNeverSentWhateverItsAge: a relay leased the message
// and stopped before its send began; the lease is taken over a day later.
// Nothing was sent, so nothing may have been applied: it is sent. (Found by
// a review: the unacknowledged time was taken at the lease, not the send.)
func TestRelaySendsAMessageNeverSentWhateverItsAge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	rv := newReceiver(t)
	keys := b.placeN(t, 1)
	stopped := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{Lease: 200 * time.Millisecond})
	outbox.SetBeforeSendHook(stopped, func(outbox.Delivery) error { return errors.New("killed") })
	_, err := stopped.RunOnce(ctx)
	require.ErrorContains(t, err, "killed")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sending' AND NOT in_send AND unacked_since IS NULL`),
		"leased, its send never begun")
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET created_at = created_at - interval '25 hours',
	lease_until = lease_until - interval '25 hours', unacked_since = unacked_since - interval '25 hours'`)
	require.NoError(t, err)

	res, err := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res)
	require.Equal(t, 1, rv.applied(t, keys[0]))
}

// TestReconcilerDoesNotCallRejectedApplied: the destination committed a
// final 422 for messages (stored and replayed by idemhttp). They were not
// applied, and sending them again gets the same 422: the reconciler marks
// them rejected, whether the relay saw the 422 (dead), lost it (pending,
// unacknowledged), or died before recording it (sending, lease expired);
// it never marks them applied, re-queues them, or asks about them again.
func TestReconcilerDoesNotCallRejectedApplied(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	rv := newReceiver(t)
	rv.reject.Store(true)
	keys := b.placeN(t, 3)
	r := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{MinBackoff: time.Hour, MaxBackoff: time.Hour})
	due := func(k string, when string) {
		t.Helper()
		_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET next_attempt_at = now() + $2::interval WHERE idempotency_key = $1`, k, when)
		require.NoError(t, err)
	}

	// keys[0]: the relay sees the 422 and makes it dead at once.
	due(keys[1], "1 hour")
	due(keys[2], "1 hour")
	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Dead: 1}, res)
	// keys[1] and keys[2]: their 422s are lost on the way back; keys[2]'s
	// relay then "dies" with the message leased.
	due(keys[1], "0")
	due(keys[2], "0")
	rv.dropResponse.Store(true)
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Retried: 2}, res)
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'sending', lease_until = now() - interval '1 second' WHERE idempotency_key = $1`, keys[2])
	require.NoError(t, err)
	for _, k := range keys {
		require.Zero(t, rv.applied(t, k))
	}

	reader := sdkmetric.NewManualReader()
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), UnackedAfter: time.Millisecond,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	require.NoError(t, err)
	time.Sleep(5 * time.Millisecond) // past UnackedAfter
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.ElementsMatch(t, keys, rep.Rejected)
	rep.Rejected = nil
	require.Equal(t, outbox.ReconcileReport{Checked: 3}, rep)
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM dedup_outbox
WHERE state = 'rejected' AND settled_at IS NOT NULL AND lease_until IS NULL AND last_error LIKE '%answered it 422%' AND requeues = 0`))
	st, err := b.ob.Stats(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(3), st.Rejected)
	require.Equal(t, int64(3), st.Enqueued())
	// The destination, not listed in Destinations, has the series of every
	// action from its first count on.
	require.Equal(t, map[string]int64{"receipts/rejected": 3, "receipts/applied": 0, "receipts/requeued": 0, "receipts/unresolved": 0}, reconciled(t, reader))

	// Settled: nothing is asked about or sent again.
	rep, err = rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, rep.Checked)
	rv.dropResponse.Store(false)
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, res)
}

// reconciled sums MetricReconciled by destination/action.
func reconciled(t *testing.T, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != outbox.MetricReconciled {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				v, _ := dp.Attributes.Value(outbox.ReconcileActionKey)
				dst, _ := dp.Attributes.Value(outbox.DestinationKey)
				got[dst.AsString()+"/"+v.AsString()] += dp.Value
			}
		}
	}
	return got
}

// TestReconcilerSeriesStartAtZero: the MetricReconciled series of every
// action of ReconcilerConfig.Destinations are there at zero once the
// Reconciler is made, before any Reconcile: PromQL's increase() sees no
// increase in a counter series that first appears at 1, so the first
// rejection of a destination would not show, nor fire an alert on it.
func TestReconcilerSeriesStartAtZero(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reader := sdkmetric.NewManualReader()
	_, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{
		Checker:       outbox.CheckerFunc(func(context.Context, outbox.Delivery) (bool, error) { return true, nil }),
		Destinations:  []string{"receipts", "ledger"},
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
	})
	require.NoError(t, err)
	want := map[string]int64{}
	for _, d := range []string{"receipts", "ledger"} {
		for _, a := range []string{"applied", "requeued", "rejected", "unresolved"} {
			want[d+"/"+a] = 0
		}
	}
	require.Equal(t, want, reconciled(t, reader))
}

// TestHTTPCheckerRejectedOnlyWithTheRefusal: a 409 is a refusal only with
// the refused request's status in its body; a bare 409 (a server still
// processing the key, say) is an unknown answer.
func TestHTTPCheckerRejectedOnlyWithTheRefusal(t *testing.T) {
	t.Parallel()
	bodies := map[string]string{
		"refused":     `{"applied":false,"status":422}`,
		"bare":        ``,
		"in-progress": `{"error":"still processing"}`,
		"no-status":   `{"applied":false}`,
		"server":      `{"applied":false,"status":503}`,
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusConflict)
		_, _ = io.WriteString(w, bodies[r.URL.Path[1:]])
	}))
	t.Cleanup(srv.Close)
	c := outbox.HTTPChecker{URL: func(_, key string) string { return srv.URL + "/" + key }}
	for key := range bodies {
		applied, err := c.Applied(context.Background(), outbox.Delivery{Key: key, Destination: "d"})
		require.False(t, applied, key)
		require.Error(t, err, key)
		require.Equal(t, key == "refused", errors.Is(err, outbox.ErrRejected), "%s: %v", key, err)
	}
}

// TestHTTPCheckerFollowsNoRedirect: a status URL that redirects (to a
// login page answering 200, say) is an unknown answer, not "applied".
func TestHTTPCheckerFollowsNoRedirect(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/login" {
			w.WriteHeader(http.StatusOK)
			return
		}
		http.Redirect(w, r, "/login", http.StatusFound)
	}))
	t.Cleanup(srv.Close)
	for name, client := range map[string]*http.Client{"DefaultClient": nil, "OwnClient": srv.Client()} {
		c := outbox.HTTPChecker{URL: func(_, key string) string { return srv.URL + "/" + key }, Client: client}
		applied, err := c.Applied(context.Background(), outbox.Delivery{Key: "k", Destination: "d"})
		require.False(t, applied, name)
		require.ErrorContains(t, err, "status 302", name)
	}
}

// TestHTTPCheckerBoundsEachCheck: a status endpoint that never answers
// fails the check after DefaultHTTPTimeout also with a Client of one's own
// (one with an authenticating Transport, as docs/outbox.md advises, and no
// Timeout). Without a bound the check waited for the run's end (the
// activity's 30 minutes), and the message, neither reported nor marked
// checked, was first again in the next run: one hung destination stopped
// the reconciliation of every message, run after run.
func TestHTTPCheckerBoundsEachCheck(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(outbox.DefaultHTTPTimeout + 10*time.Second):
		}
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(srv.Close)
	c := outbox.HTTPChecker{URL: func(_, key string) string { return srv.URL + "/" + key }, Client: &http.Client{Transport: srv.Client().Transport}}
	start := time.Now()
	applied, err := c.Applied(context.Background(), outbox.Delivery{Key: "k", Destination: "d"})
	require.Less(t, time.Since(start), outbox.DefaultHTTPTimeout+5*time.Second)
	require.False(t, applied)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotErrorIs(t, err, outbox.ErrRejected)
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
	negative := outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{"receipts": downURL}), Timeout: -time.Second}
	for _, c := range []outbox.Checker{outbox.HTTPChecker{}, &outbox.HTTPChecker{}, (*outbox.HTTPChecker)(nil), negative, &negative, outbox.CheckerFunc(nil)} {
		_, err = outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: c})
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	}
	_, err = outbox.HTTPChecker{}.Applied(context.Background(), outbox.Delivery{Key: "k", Destination: "d"})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig, "not a nil-pointer panic")
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

// TestReconcileActivityEndsBeforeItsDeadline: a run whose next check could
// end within a minute of the activity's deadline (the test environment's
// StartToClose is 10 minutes; an HTTPChecker's check takes at most its
// Timeout) asks nothing more and returns with OutOfTime, the messages left
// as they were for the next run, instead of running into the timeout.
func TestReconcileActivityEndsBeforeItsDeadline(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	keys := b.deadLetters(t, 2)
	run := func(timeout time.Duration) outbox.ReconcileReport {
		checker := rv.checker().(outbox.HTTPChecker)
		checker.Timeout = timeout
		rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: checker})
		require.NoError(t, err)
		var suite testsuite.WorkflowTestSuite
		env := suite.NewTestActivityEnvironment()
		env.RegisterActivityWithOptions(outbox.ReconcileActivity(rc), activityNamed(outbox.ReconcileActivityName(rc)))
		val, err := env.ExecuteActivity(outbox.ReconcileActivityName(rc))
		require.NoError(t, err)
		var rep outbox.ReconcileReport
		require.NoError(t, val.Get(&rep))
		return rep
	}
	rep := run(9*time.Minute + 30*time.Second)
	require.True(t, rep.OutOfTime, "a check that could end past the deadline's last minute")
	require.Zero(t, rep.Checked)
	require.Empty(t, rep.Unresolved)
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = ANY($1) AND state = 'dead' AND checked_at IS NULL`, keys), "left as they were")
	rep = run(time.Minute)
	require.False(t, rep.OutOfTime)
	require.Equal(t, 2, rep.Checked)
	require.Equal(t, 2, rep.Requeued)
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

// TestReconcilerReportsUnreadableHeaders: a dead row another producer wrote,
// whose headers are not an object of strings (the relay made it dead
// without sending it), is reported as unresolved on its own; the other
// messages of the run are still settled.
func TestReconcilerReportsUnreadableHeaders(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	ctx := context.Background()
	_, err := b.schema.Pool.Exec(ctx, `INSERT INTO dedup_outbox (idempotency_key, event_key, destination, name, headers, payload)
VALUES ('foreign-1', '', 'receipts', 'receipt', '{"a":1}', '{}')`)
	require.NoError(t, err)
	res, err := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Dead: 1}, res)
	keys := b.placeN(t, 1)
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'dead' WHERE idempotency_key = $1`, keys[0])
	require.NoError(t, err)
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker()})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, rep.Checked)
	require.Equal(t, 1, rep.Requeued, "the readable dead letter")
	require.Len(t, rep.Unresolved, 1)
	require.Equal(t, "foreign-1", rep.Unresolved[0].Key)
	require.Contains(t, rep.Unresolved[0].Reason, "never sent: its headers are not a JSON object of strings")
}

// TestReconcilerUnansweredChecksGoLast: messages whose check gets no answer
// (here: a destination the Checker cannot ask) do not hold the first
// MaxMessages places run after run; the next run asks about the others.
func TestReconcilerUnansweredChecksGoLast(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	ctx := context.Background()
	keys := b.placeN(t, 3)
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'dead', destination = 'legacy' WHERE idempotency_key = ANY($1)`, keys[:2])
	require.NoError(t, err)
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'dead' WHERE idempotency_key = $1`, keys[2])
	require.NoError(t, err)
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: rv.checker(), MaxMessages: 2})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Len(t, rep.Unresolved, 2, "the first run asks about the two first by id, and cannot")
	require.Zero(t, rep.Requeued)
	rep, err = rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Requeued, "the second asks about the one not yet asked first")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'pending'`, keys[2]))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE destination = 'legacy' AND checked_at IS NOT NULL`))
}

// TestReconcileStoppedDuringACheck: a run whose context ends while the
// Checker asks about a message returns the context's error; the message is
// not reported as unknown nor marked checked (which would move it behind
// the others at the next run).
func TestReconcileStoppedDuringACheck(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.deadLetters(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	asked := 0
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: outbox.CheckerFunc(func(ctx context.Context, _ outbox.Delivery) (bool, error) {
		asked++
		cancel() // the worker stops while the destination is asked
		<-ctx.Done()
		return false, ctx.Err()
	})})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, 1, asked)
	require.Empty(t, rep.Unresolved)
	require.Zero(t, rep.Checked)
	require.Zero(t, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE checked_at IS NOT NULL`))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'dead'`), "left as they were")
}

// TestReconcileActivityResultIsBounded: the reconcile activity's result,
// which Temporal refuses past its payload limit (2 MB by default), lists
// at most 500 unresolved messages with their texts cut to 256 bytes,
// whatever MaxMessages and the destination's errors; NotListed counts the
// rest, which are still marked checked.
func TestReconcileActivityResultIsBounded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	_, err := b.schema.Pool.Exec(ctx, `INSERT INTO dedup_outbox (idempotency_key, event_key, destination, name, headers, payload, state, last_error)
		SELECT 'key-' || g, '', 'receipts', 'receipt', '{}', '{}', 'dead', repeat('é', 1000) FROM generate_series(1, 700) g`)
	require.NoError(t, err)
	long := errors.New(strings.Repeat("the destination said no; ", 200)) // 5000 bytes
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: outbox.CheckerFunc(func(context.Context, outbox.Delivery) (bool, error) {
		return false, long
	})})
	require.NoError(t, err)
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestWorkflowEnvironment()
	outbox.RegisterReconciler(env, rc)
	env.ExecuteWorkflow("DedupOutboxReconcile", outbox.ReconcileActivityName(rc))
	require.NoError(t, env.GetWorkflowError())
	var rep outbox.ReconcileReport
	require.NoError(t, env.GetWorkflowResult(&rep))
	require.Equal(t, 700, rep.Checked)
	require.Equal(t, 500, len(rep.Unresolved))
	require.Equal(t, 200, rep.NotListed)
	for _, u := range rep.Unresolved {
		require.LessOrEqual(t, len(u.Reason), 256)
		require.LessOrEqual(t, len(u.LastError), 256)
		require.True(t, utf8.ValidString(u.LastError), "cut at a rune boundary")
	}
	p, err := converter.GetDefaultDataConverter().ToPayload(rep)
	require.NoError(t, err)
	require.Less(t, proto.Size(p), 512*1024, "under Temporal's payload warning size, let alone its limit")
	require.Equal(t, 700, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE checked_at IS NOT NULL`), "every one marked checked")
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

// TestHTTPCheckerNeedsTheAnswersBody: a 200 or a 404 says "applied" or
// "not applied" only with its JSON body. A status URL that is wrong (a
// catch-all page answering 200, another service's 404) is an unknown
// answer: a reconciler that took its 200 for "applied" settled a message
// the destination never got, and nothing would send it again.
func TestHTTPCheckerNeedsTheAnswersBody(t *testing.T) {
	t.Parallel()
	answers := map[string]struct {
		status int
		body   string
	}{
		"applied":          {http.StatusOK, `{"applied":true}`},
		"not-applied":      {http.StatusNotFound, `{"applied":false}`},
		"page":             {http.StatusOK, `<html>welcome</html>`},
		"empty-200":        {http.StatusOK, ``},
		"200-says-not":     {http.StatusOK, `{"applied":false}`},
		"other-json":       {http.StatusOK, `{"ok":true}`},
		"bare-404":         {http.StatusNotFound, `404 page not found`},
		"404-says-applied": {http.StatusNotFound, `{"applied":true}`},
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a := answers[r.URL.Path[1:]]
		w.WriteHeader(a.status)
		_, _ = io.WriteString(w, a.body)
	}))
	t.Cleanup(srv.Close)
	c := outbox.HTTPChecker{URL: func(_, key string) string { return srv.URL + "/" + key }}
	for key := range answers {
		applied, err := c.Applied(context.Background(), outbox.Delivery{Key: key, Destination: "d"})
		require.Equal(t, key == "applied", applied, key)
		if key == "applied" || key == "not-applied" {
			require.NoError(t, err, key)
			continue
		}
		require.Error(t, err, key)
		require.NotErrorIs(t, err, outbox.ErrRejected, key)
	}

	// Through a reconciler: a dead letter whose status URL answers a page
	// is reported, not settled.
	b := setup(t)
	ctx := context.Background()
	key := b.deadLetters(t, 1)[0]
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: outbox.HTTPChecker{
		URL: func(string, string) string { return srv.URL + "/page" }}})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, rep.Applied)
	require.Len(t, rep.Unresolved, 1)
	require.Contains(t, rep.Unresolved[0].Reason, `status 200, without the body {"applied":true}`)
	var state string
	require.NoError(t, b.schema.Pool.QueryRow(ctx, `SELECT state FROM dedup_outbox WHERE idempotency_key = $1`, key).Scan(&state))
	require.Equal(t, "dead", state)
}

// TestReconcilerRequeueStartsTheUnackedClockAgain pins the re-queue of a
// pending message unacknowledged past UnackedAfter: it is due at once and
// its unacknowledged time starts again (from the question), so the next
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
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND next_attempt_at <= now()
	AND unacked_since BETWEEN now() - interval '1 minute' AND now()`))
}

// TestReconcilerWaitsWhenAsked: a status endpoint that answers with
// Retry-After (a 429 here) is asked nothing more until the wait is over,
// in that run and the next; its other messages are neither reported nor
// marked checked, and cannot take the places of other destinations'
// messages. A 409's Retry-After (a key still in progress) asks no wait of
// the destination.
func TestReconcilerWaitsWhenAsked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rv := newReceiver(t)
	ctx := context.Background()
	limited, limitedHits := answering(t, http.StatusTooManyRequests, "120")
	down, downHits := answering(t, http.StatusConflict, "120") // a key still in progress: the key's wait alone
	keys := b.deadLetters(t, 5)
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET destination = 'limited' WHERE idempotency_key = ANY($1)`, keys[:2])
	require.NoError(t, err)
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET destination = 'down' WHERE idempotency_key = ANY($1)`, keys[2:4])
	require.NoError(t, err)
	checker := outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{
		"limited": limited.URL, "down": down.URL, "receipts": rv.URL + "/idempotency-keys"})}
	sr := tracetest.NewSpanRecorder()
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: checker,
		TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))})
	require.NoError(t, err)

	asked := time.Now()
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), limitedHits.Load(), "the second of limited's messages is not asked")
	require.Equal(t, int64(2), downHits.Load(), "a 409's Retry-After asks no wait of the destination")
	require.Equal(t, 4, rep.Checked)
	require.Equal(t, 1, rep.Requeued)
	require.Len(t, rep.Unresolved, 3)
	require.Equal(t, keys[0], rep.Unresolved[0].Key)
	require.Contains(t, rep.Unresolved[0].Reason, "status 429 (Retry-After: 2m0s)")
	require.Len(t, rep.Waiting, 1)
	require.WithinRange(t, rep.Waiting["limited"], asked.Add(2*time.Minute), time.Now().Add(2*time.Minute))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE destination = 'limited' AND state = 'dead' AND checked_at IS NULL`),
		"the message not asked keeps its place")
	spans := sr.Ended()
	require.Len(t, spans, 1)
	require.Subset(t, spans[0].Attributes(), []attribute.KeyValue{
		attribute.Int("dedup.outbox.reconcile.checked", 4),
		attribute.Int("dedup.outbox.reconcile.unresolved", 3),
		attribute.Int("dedup.outbox.reconcile.waiting", 1),
	})

	rep, err = rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), limitedHits.Load(), "the next run waits too")
	require.Equal(t, int64(4), downHits.Load())
	require.Equal(t, 2, rep.Checked)
	require.Len(t, rep.Unresolved, 2)
	require.Contains(t, rep.Waiting, "limited")

	// With one place per run, the waiting destination's messages, asked
	// longest ago, would hold it: they are left out of the run's query.
	one, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: checker, MaxMessages: 1})
	require.NoError(t, err)
	rep, err = one.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(2), limitedHits.Load(), "a Reconciler of its own learns the wait by asking")
	require.Equal(t, keys[1], rep.Unresolved[0].Key, "the message never asked comes first")
	rep, err = one.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(2), limitedHits.Load())
	require.Equal(t, int64(5), downHits.Load(), "the place goes to another destination's message")
	require.Equal(t, 1, rep.Checked)
}

// TestReconcilerWaitEnds: a Checker's RetryAfter is a wait of at most
// MaxWait; once it is over, the destination's messages are asked again,
// those not asked first.
func TestReconcilerWaitEnds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	keys := b.deadLetters(t, 3)
	var asked []string
	checker := outbox.CheckerFunc(func(_ context.Context, d outbox.Delivery) (bool, error) {
		asked = append(asked, d.Key)
		if len(asked) == 1 {
			return false, outbox.RetryAfter(errors.New("rate limited"), time.Hour)
		}
		return true, nil
	})
	_, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: checker, MaxWait: -time.Second})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	const maxWait = 2 * time.Second
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: checker, MaxWait: maxWait})
	require.NoError(t, err)

	before := time.Now()
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, keys[:1], asked)
	until := rep.Waiting["receipts"]
	require.WithinRange(t, until, before.Add(maxWait), time.Now().Add(maxWait), "an hour asked, MaxWait given")
	rep, err = rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Len(t, asked, 1)
	require.Zero(t, rep.Checked)

	time.Sleep(time.Until(until) + 10*time.Millisecond)
	rep, err = rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{keys[0], keys[1], keys[2], keys[0]}, asked, "never asked first, then the one asked")
	require.Equal(t, 3, rep.Applied)
	require.Nil(t, rep.Waiting)
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'applied'`))
}

// TestReconcilerStoppedRunKeepsTheWait: an answer that asks for a wait and
// comes as the run stops is still a wait, as it is for the relay
// (TestRelayStoppedPassKeepsTheWait): the next run does not ask that
// destination again before it is over.
func TestReconcilerStoppedRunKeepsTheWait(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.deadLetters(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var asked atomic.Int64
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: outbox.CheckerFunc(func(context.Context, outbox.Delivery) (bool, error) {
		asked.Add(1)
		cancel() // the run stops as the answer comes
		return false, outbox.RetryAfter(errors.New("rate limited"), 2*time.Minute)
	})})
	require.NoError(t, err)
	_, err = rc.Reconcile(ctx)
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, int64(1), asked.Load())

	rep, err := rc.Reconcile(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(1), asked.Load(), "the destination asked to wait")
	require.Zero(t, rep.Checked)
	require.Contains(t, rep.Waiting, "receipts")
}

// TestCheckerPanicIsAnUnknownAnswer: a Checker that panics on one message
// (a bug in a custom Checker, say) leaves that message unresolved and
// marked checked, and the run goes on to settle the others, as a Sender's
// panic is a failed send. The states are read by SQL.
func TestCheckerPanicIsAnUnknownAnswer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	keys := b.deadLetters(t, 2)
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: outbox.CheckerFunc(func(_ context.Context, d outbox.Delivery) (bool, error) {
		if d.Key == keys[0] {
			panic("checker bug")
		}
		return false, nil
	})})
	require.NoError(t, err)
	var rep outbox.ReconcileReport
	require.NotPanics(t, func() { rep, err = rc.Reconcile(context.Background()) })
	require.NoError(t, err)
	require.Equal(t, 2, rep.Checked)
	require.Equal(t, 1, rep.Requeued)
	require.Len(t, rep.Unresolved, 1)
	require.Equal(t, keys[0], rep.Unresolved[0].Key)
	require.Contains(t, rep.Unresolved[0].Reason, "checker bug")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'dead' AND checked_at IS NOT NULL`, keys[0]))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'pending' AND requeues = 1`, keys[1]))
}

// TestReconcilerRequeuesNothingSentSinceItAsked: the reconciler asks about
// a pending message unacknowledged for an hour, and its destination
// answers "not applied". While it asks, a relay sends the message (applied
// at the destination) and stops before it can record the send, so it
// gives the message back as it was read: pending, the same attempts. The
// reconciler must not re-queue it, which would start its unacknowledged
// time anew: then, its relays down for a day and the destination's key
// pruned, the relay sends it again and the destination applies it twice.
// The receipts are counted by SQL at the destination.
func TestReconcilerRequeuesNothingSentSinceItAsked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	rv := newReceiver(t)
	keys := b.placeN(t, 1)
	// Its earlier sends failed (the destination was down): pending, due,
	// first sent an hour ago.
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET attempts = 1, tries = 1, next_attempt_at = now(),
	unacked_since = now() - interval '1 hour'`)
	require.NoError(t, err)

	http := httpSender(t, rv.URL+"/receipts")
	var stopping *outbox.Relay
	passCtx, stop := context.WithCancel(ctx)
	defer stop()
	stopping, err = outbox.NewRelay(b.ob, outbox.RelayConfig{Sender: outbox.SenderFunc(func(ctx context.Context, d outbox.Delivery) error {
		err := http.Send(ctx, d) // applied at the destination
		stop()                   // and the relay stops before it sees the answer
		return errors.Join(err, context.Canceled)
	})})
	require.NoError(t, err)
	asked := 0
	checker := rv.checker()
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: outbox.CheckerFunc(func(ctx context.Context, d outbox.Delivery) (bool, error) {
		asked++
		applied, err := checker.Applied(ctx, d)
		if asked == 1 {
			_, rerr := stopping.RunOnce(passCtx)
			require.ErrorIs(t, rerr, context.Canceled)
		}
		return applied, err
	})})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Checked)
	require.Equal(t, 1, rv.applied(t, keys[0]), "applied once, while the reconciler asked")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND attempts = 1 AND unacked_since < now() - interval '59 minutes'`),
		"given back as it was, its unacknowledged time kept")

	// A day later: the relays were down, the destination pruned the key.
	_, err = rv.schema.Pool.Exec(ctx, `UPDATE dedup_marker SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	d, err := dedupactivity.New(rv.schema.Pool, dedupactivity.Options{})
	require.NoError(t, err)
	n, err := d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET created_at = created_at - interval '25 hours',
	unacked_since = unacked_since - interval '25 hours', next_attempt_at = now()`)
	require.NoError(t, err)
	res, err := b.relayTo(t, rv.URL+"/receipts", outbox.RelayConfig{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Dead: 1}, res, "not sent again")
	require.Equal(t, 1, rv.applied(t, keys[0]), "applied once")
}

// slowDestination is a destination that, as Stripe does, finishes a request
// whose client has gone (timed out): each POST waits until finish is
// closed, then applies its key once (a second POST of a key it remembers
// applies nothing). GET /status/{key} answers as idemhttp's StatusHandler
// does: 200 {"applied":true} for a key it remembers, else 404
// {"applied":false}. forget drops every key, as a destination's key retention does.
type slowDestination struct {
	*httptest.Server
	finish  chan struct{}
	mu      sync.Mutex
	keys    map[string]bool
	applies map[string]int // every application of a key, remembered or not
	once    sync.Once
}

// release lets the POSTs waiting and to come finish.
func (sd *slowDestination) release() { sd.once.Do(func() { close(sd.finish) }) }

func newSlowDestination(t *testing.T) *slowDestination {
	t.Helper()
	sd := &slowDestination{finish: make(chan struct{}), keys: map[string]bool{}, applies: map[string]int{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /receipts", func(w http.ResponseWriter, r *http.Request) {
		<-sd.finish // whatever the client does meanwhile
		key := r.Header.Get(outbox.IdempotencyKeyHeader)
		sd.mu.Lock()
		if !sd.keys[key] {
			sd.keys[key] = true
			sd.applies[key]++
		}
		sd.mu.Unlock()
		w.WriteHeader(http.StatusCreated)
	})
	mux.HandleFunc("GET /status/{key}", func(w http.ResponseWriter, r *http.Request) {
		sd.mu.Lock()
		defer sd.mu.Unlock()
		if sd.keys[r.PathValue("key")] {
			w.WriteHeader(http.StatusOK)
			_, _ = io.WriteString(w, `{"applied":true}`)
			return
		}
		w.WriteHeader(http.StatusNotFound)
		_, _ = io.WriteString(w, `{"applied":false}`)
	})
	sd.Server = httptest.NewServer(mux)
	t.Cleanup(sd.Close)
	t.Cleanup(sd.release) // before Close, which waits for the POSTs
	return sd
}

func (sd *slowDestination) applied(key string) int {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	return sd.applies[key]
}

func (sd *slowDestination) forget() {
	sd.mu.Lock()
	defer sd.mu.Unlock()
	sd.keys = map[string]bool{}
}

// TestReconcilerRequeueCountsFromItsQuestion: a send times out at the relay
// while the destination goes on with it; the reconciler asks before the
// destination has applied it, hears "not applied", and re-queues it. The
// destination then applies the send. The message's unacknowledged time
// runs from the question, not from the next send: its relays down for a
// day after the re-queue and the destination's key gone, the relay makes
// it dead instead of sending it, and it is applied once, as counted by the
// destination.
func TestReconcilerRequeueCountsFromItsQuestion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	sd := newSlowDestination(t)
	keys := b.placeN(t, 1)
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET attempts = 1, tries = 1, next_attempt_at = now(),
	unacked_since = now() - interval '1 hour'`)
	require.NoError(t, err)

	sender, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{"receipts": sd.URL + "/receipts"}, Timeout: 200 * time.Millisecond})
	require.NoError(t, err)
	r, err := outbox.NewRelay(b.ob, outbox.RelayConfig{Sender: sender, MinBackoff: time.Hour, MaxBackoff: time.Hour})
	require.NoError(t, err)
	res, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Retried: 1}, res, "timed out at the relay")

	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{
		Checker: outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{"receipts": sd.URL + "/status"})}})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.ReconcileReport{Checked: 1, Requeued: 1}, rep, "not applied yet")
	sd.release()
	require.Eventually(t, func() bool { return sd.applied(keys[0]) == 1 }, 5*time.Second, 10*time.Millisecond, "applied after the question")

	// A day later: no relay ran, the destination forgot the key.
	sd.forget()
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET created_at = created_at - interval '25 hours',
	unacked_since = unacked_since - interval '25 hours', next_attempt_at = now()`)
	require.NoError(t, err)
	res, err = r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, sd.applied(keys[0]), "applied once")
	require.Equal(t, outbox.RelayResult{Dead: 1}, res, "not sent again")
}

// TestReconcilerKeyRetentionAtTheAnswer: whether a message was first sent
// longer ago than KeyRetention is decided when its destination answers,
// not when the run read it. A run asks one message after another (each
// up to the Checker's timeout, MaxMessages of them), so a message just
// inside KeyRetention as the run began may be past it, its key forgotten,
// when its destination answers "not applied": re-queued then (its
// unacknowledged time started anew), the relay sends it again and the
// destination applies it twice. Here the first check takes 1.5s and the
// second message, first sent 2s before the run, is answered 3.5s after
// that send, past a KeyRetention of 3s: it is reported, not re-queued.
// The states are read by SQL.
func TestReconcilerKeyRetentionAtTheAnswer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t)
	keys := b.deadLetters(t, 2)
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET attempts = 1,
	unacked_since = CASE WHEN idempotency_key = $1 THEN now() ELSE now() - interval '2 seconds' END`, keys[0])
	require.NoError(t, err)
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{KeyRetention: 3 * time.Second,
		Checker: outbox.CheckerFunc(func(_ context.Context, d outbox.Delivery) (bool, error) {
			if d.Key == keys[0] {
				time.Sleep(1500 * time.Millisecond) // a slow status endpoint
			}
			return false, nil
		})})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, rep.Checked)
	require.Equal(t, 1, rep.Requeued, "the first, sent just now")
	require.Len(t, rep.Unresolved, 1)
	require.Equal(t, keys[1], rep.Unresolved[0].Key)
	require.Contains(t, rep.Unresolved[0].Reason, "first sent more than KeyRetention (3s) ago")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1 AND state = 'dead' AND requeues = 0`, keys[1]))
}

// TestReconcilerRequeueOfAnUnbegunLeaseGivesItsTryBack: a message whose
// lease ended before its send began (its relay stopped first) is not
// charged that try when the reconciler re-queues it, as it is not when a
// relay takes the lease over. With MaxAttempts 3 and two real sends failed,
// the message is pending (tries 2), not dead.
func TestReconcilerRequeueOfAnUnbegunLeaseGivesItsTryBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, func(string, int) int { return http.StatusServiceUnavailable })
	keys := b.placeN(t, 1)
	ctx := context.Background()
	// One send failed long ago; then a lease under which no send began ended.
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'sending', attempts = 2, tries = 2, in_send = false,
	unacked_since = now() - interval '10 minutes', lease_until = now() - interval '1 second'`)
	require.NoError(t, err)
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{
		Checker: outbox.CheckerFunc(func(context.Context, outbox.Delivery) (bool, error) { return false, nil })})
	require.NoError(t, err)
	rep, err := rc.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Requeued)
	_, err = b.relay(t, dest, outbox.RelayConfig{MaxAttempts: 3}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, dest.count(keys[0]))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending' AND tries = 2`), "two sends, not three")
}
