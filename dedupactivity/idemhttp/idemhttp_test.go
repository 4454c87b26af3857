package idemhttp_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/idemhttp"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type testBundle struct {
	schema *pgtest.Schema
	m      *idemhttp.Middleware
	srv    *httptest.Server
	runs   atomic.Int64 // handler runs
	// gate, when non-nil, holds the handler until closed.
	gate    chan struct{}
	entered chan struct{}
	status  atomic.Int64 // status the handler answers; 0 = 201
}

// setup serves POST /receipts: the handler inserts a receipt row through
// the request's transaction and answers 201 with a Location.
func setup(t *testing.T, opts idemhttp.Options) *testBundle {
	t.Helper()
	s, m := newMiddleware(t, opts)
	b := &testBundle{schema: s, m: m, entered: make(chan struct{}, 16)}
	mux := http.NewServeMux()
	mux.Handle("POST /receipts", m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.runs.Add(1)
		body, _ := io.ReadAll(r.Body)
		tx, ok := idemhttp.Tx(r.Context())
		if !ok {
			w.WriteHeader(http.StatusAccepted) // no key: nothing stored
			return
		}
		var id int64
		if err := tx.QueryRow(r.Context(), `INSERT INTO receipt (body) VALUES ($1) RETURNING id`, string(body)).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		b.entered <- struct{}{}
		if b.gate != nil {
			<-b.gate
		}
		status := int(b.status.Load())
		if status == 0 {
			status = http.StatusCreated
		}
		w.Header().Set("Location", "/receipts/"+itoa(id))
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Not-Replayed", "1")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(map[string]int64{"id": id})
	})))
	mux.Handle("GET /idempotency-keys/{key}", m.StatusHandler())
	b.srv = httptest.NewServer(mux)
	t.Cleanup(b.srv.Close)
	return b
}

// newMiddleware gives the test its own schema with a migrated Middleware
// and a receipt table.
func newMiddleware(t *testing.T, opts idemhttp.Options) (*pgtest.Schema, *idemhttp.Middleware) {
	t.Helper()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	m, err := idemhttp.New(s.Pool, opts)
	require.NoError(t, err)
	require.NoError(t, m.Migrate(ctx))
	_, err = s.Pool.Exec(ctx, `CREATE TABLE receipt (id bigserial PRIMARY KEY, body text NOT NULL)`)
	require.NoError(t, err)
	return s, m
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

type reply struct {
	status int
	header http.Header
	body   string
}

func (b *testBundle) post(t *testing.T, path, key, body string) reply {
	t.Helper()
	h := http.Header{}
	if key != "" {
		h.Set("Idempotency-Key", key)
	}
	return b.do(t, http.MethodPost, path, h, body)
}

// keyStatus asks StatusHandler about key.
func (b *testBundle) keyStatus(t *testing.T, key string) reply {
	t.Helper()
	return b.do(t, http.MethodGet, "/idempotency-keys/"+key, nil, "")
}

// do sends a request with headers h and returns the reply.
func (b *testBundle) do(t *testing.T, method, path string, h http.Header, body string) reply {
	t.Helper()
	req, err := http.NewRequest(method, b.srv.URL+path, strings.NewReader(body))
	require.NoError(t, err)
	for k, v := range h {
		req.Header[k] = v
	}
	resp, err := b.srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return reply{resp.StatusCode, resp.Header, string(got)}
}

func (b *testBundle) receipts(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.schema.Pool.QueryRow(context.Background(), `SELECT count(*) FROM receipt`).Scan(&n))
	return n
}

func TestFirstRequestCommitsAndReplayReturnsStoredResponse(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	first := b.post(t, "/receipts", "k1", `{"amount":5}`)
	require.Equal(t, http.StatusCreated, first.status)
	require.NotEmpty(t, first.header.Get("Location"))
	require.Equal(t, "1", first.header.Get("X-Not-Replayed"), "the first response carries every header")
	require.Empty(t, first.header.Get(idemhttp.ReplayedHeader))
	require.Equal(t, 1, b.receipts(t))

	for range 3 {
		again := b.post(t, "/receipts", "k1", `{"amount":5}`)
		require.Equal(t, first.status, again.status)
		require.Equal(t, first.body, again.body)
		require.Equal(t, first.header.Get("Location"), again.header.Get("Location"))
		require.Equal(t, "application/json", again.header.Get("Content-Type"))
		require.Empty(t, again.header.Get("X-Not-Replayed"), "only ReplayHeaders are stored")
		require.Equal(t, "true", again.header.Get(idemhttp.ReplayedHeader))
	}
	require.Equal(t, 1, b.receipts(t), "applied once")
	require.Equal(t, int64(1), b.runs.Load())

	other := b.post(t, "/receipts", "k2", `{"amount":5}`)
	require.Equal(t, http.StatusCreated, other.status)
	require.Equal(t, 2, b.receipts(t), "another key is another request")
}

func TestSameKeyDifferentRequestIs422(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	require.Equal(t, http.StatusCreated, b.post(t, "/receipts", "k1", `{"amount":5}`).status)
	r := b.post(t, "/receipts", "k1", `{"amount":6}`)
	require.Equal(t, http.StatusUnprocessableEntity, r.status)
	require.Contains(t, r.body, "different request")
	r = b.post(t, "/receipts?x=1", "k1", `{"amount":5}`)
	require.Equal(t, http.StatusUnprocessableEntity, r.status, "the path is part of the request")
	require.Equal(t, 1, b.receipts(t))
	require.Equal(t, int64(1), b.runs.Load())
}

func TestInFlightRequestGets409AfterBoundedWait(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{InFlightWait: 200 * time.Millisecond})
	b.gate = make(chan struct{})
	// Released by a cleanup too, which runs before the server's Close: an
	// assertion failing while the first request is held would otherwise
	// leave Close waiting for it, and the failure would show only as the
	// test binary's timeout.
	release := sync.OnceFunc(func() { close(b.gate) })
	t.Cleanup(release)
	firstDone := make(chan reply, 1)
	go func() { firstDone <- b.post(t, "/receipts", "k1", `{}`) }()
	<-b.entered // the first request holds the key

	second := b.post(t, "/receipts", "k1", `{}`)
	require.Equal(t, http.StatusConflict, second.status)
	require.Equal(t, "1", second.header.Get("Retry-After"))

	release()
	first := <-firstDone
	require.Equal(t, http.StatusCreated, first.status)
	third := b.post(t, "/receipts", "k1", `{}`)
	require.Equal(t, first.body, third.body)
	require.Equal(t, "true", third.header.Get(idemhttp.ReplayedHeader))
	require.Equal(t, 1, b.receipts(t))
}

func TestInFlightRequestGetsReplayWhenFirstEndsWithinWait(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{InFlightWait: 10 * time.Second})
	b.gate = make(chan struct{})
	firstDone := make(chan reply)
	go func() { firstDone <- b.post(t, "/receipts", "k1", `{}`) }()
	<-b.entered
	secondDone := make(chan reply)
	go func() { secondDone <- b.post(t, "/receipts", "k1", `{}`) }()
	time.Sleep(100 * time.Millisecond) // let the second request reach the wait (correct without it too)
	close(b.gate)
	first, second := <-firstDone, <-secondDone
	require.Equal(t, http.StatusCreated, first.status)
	require.Equal(t, http.StatusCreated, second.status)
	require.Equal(t, first.body, second.body)
	require.Equal(t, 1, b.receipts(t))
}

func TestConcurrentSameKeyAppliesOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{InFlightWait: 5 * time.Second})
	var wg sync.WaitGroup
	var mu sync.Mutex
	bodies := map[string]int{}
	for range 8 {
		wg.Go(func() {
			r := b.post(t, "/receipts", "same", `{"amount":1}`)
			mu.Lock()
			defer mu.Unlock()
			bodies[itoa(int64(r.status))+" "+r.body]++
		})
	}
	wg.Wait()
	require.Len(t, bodies, 1, "every request got the same response: %v", bodies)
	require.Equal(t, 1, b.receipts(t))
}

func TestServerErrorRollsBackAndIsNotStored(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusServiceUnavailable, http.StatusTooManyRequests, http.StatusConflict, http.StatusRequestTimeout, http.StatusTooEarly} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			t.Parallel()
			testNotStored(t, status)
		})
	}
}

// testNotStored: a response asking for a retry (5xx, or a 4xx the outbox's
// HTTPSender retries) rolls the handler back and is not stored, so the
// retry runs the handler again and the key is not applied.
func testNotStored(t *testing.T, status int) {
	b := setup(t, idemhttp.Options{})
	b.status.Store(int64(status))
	r := b.post(t, "/receipts", "k1", `{}`)
	require.Equal(t, status, r.status, "passed on")
	require.Zero(t, b.receipts(t), "the handler's insert rolled back")
	applied, err := b.m.Applied(context.Background(), "k1")
	require.NoError(t, err)
	require.False(t, applied)

	b.status.Store(0)
	r = b.post(t, "/receipts", "k1", `{}`)
	require.Equal(t, http.StatusCreated, r.status, "the retry runs the handler again")
	require.Empty(t, r.header.Get(idemhttp.ReplayedHeader))
	require.Equal(t, 1, b.receipts(t))
}

func TestClientErrorIsStored(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	b.status.Store(http.StatusBadRequest)
	require.Equal(t, http.StatusBadRequest, b.post(t, "/receipts", "k1", `{}`).status)
	b.status.Store(0)
	r := b.post(t, "/receipts", "k1", `{}`)
	require.Equal(t, http.StatusBadRequest, r.status, "a 4xx is the request's result, replayed")
	require.Equal(t, "true", r.header.Get(idemhttp.ReplayedHeader))
	require.Equal(t, int64(1), b.runs.Load())
}

func TestMissingKey(t *testing.T) {
	t.Parallel()
	pass := setup(t, idemhttp.Options{})
	r := pass.post(t, "/receipts", "", `{}`)
	require.Equal(t, http.StatusAccepted, r.status, "passed through without a transaction")
	require.Equal(t, int64(1), pass.runs.Load())

	strict := setup(t, idemhttp.Options{RequireKey: true})
	r = strict.post(t, "/receipts", "", `{}`)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Contains(t, r.body, "Idempotency-Key")
	require.Zero(t, strict.runs.Load())
}

func TestLimits(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{MaxBodyBytes: 10})
	r := b.post(t, "/receipts", "k", strings.Repeat("x", 11))
	require.Equal(t, http.StatusRequestEntityTooLarge, r.status)
	require.JSONEq(t, `{"error":"body larger than 10 bytes"}`, r.body)
	require.Equal(t, http.StatusBadRequest, b.post(t, "/receipts", strings.Repeat("k", 256), `{}`).status)
	require.Zero(t, b.runs.Load())
	require.Equal(t, http.StatusCreated, b.post(t, "/receipts", "k", strings.Repeat("x", 10)).status, "a body of MaxBodyBytes is accepted")
}

func TestStatusHandlerAnswersApplied(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	get := func(key string) int { return b.keyStatus(t, key).status }
	require.Equal(t, http.StatusNotFound, get("k1"))
	require.Equal(t, http.StatusCreated, b.post(t, "/receipts", "k1", `{}`).status)
	require.Equal(t, http.StatusOK, get("k1"))
	require.Equal(t, http.StatusNotFound, get("k2"))

	// A final 4xx is stored and replayed, but the request was refused, not
	// applied.
	b.status.Store(http.StatusPaymentRequired)
	require.Equal(t, http.StatusPaymentRequired, b.post(t, "/receipts", "k3", `{}`).status)
	r := b.keyStatus(t, "k3")
	require.Equal(t, http.StatusConflict, r.status)
	require.JSONEq(t, `{"applied":false,"status":402}`, r.body)
	applied, err := b.m.Applied(context.Background(), "k3")
	require.False(t, applied)
	require.ErrorIs(t, err, outbox.ErrRejected)
	var rejected *idemhttp.RejectedError
	require.ErrorAs(t, err, &rejected)
	require.Equal(t, http.StatusPaymentRequired, rejected.Status)
	applied, err = b.m.Applied(context.Background(), "k1")
	require.NoError(t, err)
	require.True(t, applied)
}

// TestStatusHandlerBlankKeyIs400: a status request whose key is only
// spaces or tabs carries no key (they are not part of a key, as in the
// header) and gets 400, as one without a key does: it got a 500 logged as
// an error, the store's "empty business key", which a checker takes for a
// failure of the service.
func TestStatusHandlerBlankKeyIs400(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	for _, path := range []string{"/idempotency-keys/%20", "/idempotency-keys/%09%20"} {
		r := b.do(t, http.MethodGet, path, nil, "")
		require.Equal(t, http.StatusBadRequest, r.status, "%s: %s", path, r.body)
		require.JSONEq(t, `{"error":"no key"}`, r.body)
	}
}

// TestStatusHandlerLongKeyIs400: a status request whose key is longer
// than MaxKeyLength, which no request could have been applied under (the
// middleware refuses it with 400), gets 400 as that request does. A key
// past the store's identity bound got a 500 logged as an error
// ("identity too large"), a failure of the service for a client's mistake.
func TestStatusHandlerLongKeyIs400(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	for _, n := range []int{idemhttp.MaxKeyLength + 1, 70 << 10} {
		r := b.keyStatus(t, strings.Repeat("k", n))
		require.Equal(t, http.StatusBadRequest, r.status, "%d bytes: %s", n, r.body)
		require.Contains(t, r.body, "longer than 255 bytes")
	}
	require.Equal(t, http.StatusNotFound, b.keyStatus(t, strings.Repeat("k", idemhttp.MaxKeyLength)).status, "the longest key is asked about")
}

func TestScopesSeparateKeys(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	a, err := idemhttp.New(s.Pool, idemhttp.Options{Scope: "a"})
	require.NoError(t, err)
	require.NoError(t, a.Migrate(context.Background()))
	bm, err := idemhttp.New(s.Pool, idemhttp.Options{Scope: "b"})
	require.NoError(t, err)
	h := func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }
	for _, m := range []*idemhttp.Middleware{a, bm} {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k")
		m.Handler(http.HandlerFunc(h)).ServeHTTP(rec, req)
		require.Equal(t, http.StatusCreated, rec.Code)
		require.Empty(t, rec.Header().Get(idemhttp.ReplayedHeader), "not a replay in the other scope")
	}
	_, err = idemhttp.New(s.Pool, idemhttp.Options{Dedup: dedupactivity.Options{Table: "Bad"}})
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	// What would break a replay or the 422 is refused.
	_, err = idemhttp.New(s.Pool, idemhttp.Options{Dedup: dedupactivity.Options{DiscardResults: true}})
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	_, err = idemhttp.New(s.Pool, idemhttp.Options{Dedup: dedupactivity.Options{MismatchPolicy: dedupactivity.MismatchReturnStored}})
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	// Request keys are business keys, which the partitioned layout refuses.
	_, err = idemhttp.New(s.Pool, idemhttp.Options{Dedup: dedupactivity.Options{PartitionInterval: time.Hour}})
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	// A bad InFlightWait is named as the caller set it, not as the
	// Dedup.ClaimWait it becomes.
	for _, wait := range []time.Duration{-time.Second, time.Microsecond, 25 * time.Hour} {
		_, err = idemhttp.New(s.Pool, idemhttp.Options{InFlightWait: wait})
		require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
		require.ErrorContains(t, err, "InFlightWait")
		require.NotContains(t, err.Error(), "ClaimWait")
	}
}

// TestCallersHaveTheirOwnKeys: with Options.Caller, the same key from two
// callers is two requests, each applied once and replayed only to its own
// caller; StatusHandler and AppliedFor answer per caller; a Middleware
// without a Caller on the same Scope and table does not see the callers'
// keys.
func TestCallersHaveTheirOwnKeys(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{Caller: func(r *http.Request) string { return r.Header.Get("X-Account") }})
	ctx := context.Background()
	send := func(method, path, account, key, body string) reply {
		h := http.Header{"X-Account": {account}}
		if key != "" {
			h.Set("Idempotency-Key", key)
		}
		return b.do(t, method, path, h, body)
	}

	first := map[string]reply{}
	// Pairs whose caller and key join to the same text, with or without a
	// separator, are still apart.
	pairs := []struct{ account, key string }{{"A", "k"}, {"B", "k"}, {"", "k"}, {"a", "bk"}, {"ab", "k"}, {"a:", "b"}, {"a", ":b"}, {strings.Repeat("x", 100_000), "k"}}
	for _, c := range pairs {
		r := send(http.MethodPost, "/receipts", c.account, c.key, `{}`)
		require.Equal(t, http.StatusCreated, r.status, c)
		require.Empty(t, r.header.Get(idemhttp.ReplayedHeader), "%v: another caller's key is not a replay", c)
		first[c.account+"/"+c.key] = r
	}
	require.Equal(t, len(pairs), b.receipts(t))
	for _, c := range pairs {
		r := send(http.MethodPost, "/receipts", c.account, c.key, `{}`)
		require.Equal(t, "true", r.header.Get(idemhttp.ReplayedHeader), c)
		require.Equal(t, first[c.account+"/"+c.key].body, r.body, "%v: its own answer", c)
	}
	require.Equal(t, len(pairs), b.receipts(t))

	require.Equal(t, http.StatusOK, send(http.MethodGet, "/idempotency-keys/k", "A", "", "").status)
	require.Equal(t, http.StatusNotFound, send(http.MethodGet, "/idempotency-keys/k", "C", "", "").status)
	applied, err := b.m.AppliedFor(ctx, "B", "k")
	require.NoError(t, err)
	require.True(t, applied)
	applied, err = b.m.AppliedFor(ctx, "C", "k")
	require.NoError(t, err)
	require.False(t, applied)
	_, err = b.m.Applied(ctx, "k")
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions, "keys are per caller")
	_, err = b.m.AppliedFor(ctx, "A", "")
	require.ErrorIs(t, err, dedupactivity.ErrEmptyBusinessKey)

	shared, err := idemhttp.New(b.schema.Pool, idemhttp.Options{})
	require.NoError(t, err)
	sum := sha256.Sum256([]byte("A"))
	for _, key := range []string{"k", hex.EncodeToString(sum[:]) + "k"} { // A's key k, spelled as a caller's key is joined
		applied, err = shared.Applied(ctx, key)
		require.NoError(t, err)
		require.False(t, applied, "%s: a Middleware without a Caller has keys apart", key)
	}
}

// TestEarlyHintsAreNotTheAnswer: a 1xx before the final status is not
// stored as the answer: a 500 after a 103 rolls back and is not replayed,
// and a 201 after a 103 is what is stored.
func TestEarlyHintsAreNotTheAnswer(t *testing.T) {
	t.Parallel()
	s, m := newMiddleware(t, idemhttp.Options{})
	ctx := context.Background()
	var final atomic.Int64
	final.Store(http.StatusInternalServerError)
	h := m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idemhttp.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), `INSERT INTO receipt (body) VALUES ($1)`, "x"); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusEarlyHints)
		w.WriteHeader(int(final.Load()))
	}))
	post := func() *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k")
		h.ServeHTTP(rec, req)
		return rec
	}
	count := func() (n int) {
		require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM receipt`).Scan(&n))
		return n
	}
	require.Equal(t, http.StatusInternalServerError, post().Code)
	require.Zero(t, count(), "the 500 rolled back")
	final.Store(http.StatusCreated)
	require.Equal(t, http.StatusCreated, post().Code)
	replay := post()
	require.Equal(t, http.StatusCreated, replay.Code)
	require.Equal(t, "true", replay.Header().Get(idemhttp.ReplayedHeader))
	require.Equal(t, 1, count())
}

// TestStoreFailureIs500WithoutDetails: when the store fails (here its table
// is gone), the client gets a 500 that names nothing of the database, and
// the error goes to Options.Logger.
func TestStoreFailureIs500WithoutDetails(t *testing.T) {
	t.Parallel()
	var logged bytes.Buffer
	b := setup(t, idemhttp.Options{Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	_, err := b.schema.Pool.Exec(context.Background(), `DROP TABLE dedup_marker`)
	require.NoError(t, err)
	for _, got := range []reply{b.post(t, "/receipts", "k", `{}`), b.keyStatus(t, "k")} {
		require.Equal(t, http.StatusInternalServerError, got.status)
		require.JSONEq(t, `{"error":"internal error"}`, got.body)
	}
	require.Equal(t, 2, strings.Count(logged.String(), "dedup_marker"), "both errors are logged, with the database's words: %s", logged.String())
	require.Zero(t, b.runs.Load(), "the handler never ran")
}

// TestRedirectIsStoredAndRefused: a 3xx is final, so it is stored and
// replayed like a 4xx, and it is not "applied" (the effect the sender asked
// for did not happen here): Applied returns a RejectedError with its status
// and StatusHandler answers 409 with it.
func TestRedirectIsStoredAndRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	client := *b.srv.Client()
	client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	post := func() *http.Response {
		req, err := http.NewRequest(http.MethodPost, b.srv.URL+"/receipts", strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "k1")
		resp, err := client.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	b.status.Store(http.StatusSeeOther)
	require.Equal(t, http.StatusSeeOther, post().StatusCode)
	b.status.Store(0)
	again := post()
	require.Equal(t, http.StatusSeeOther, again.StatusCode, "replayed, not run again")
	require.Equal(t, "true", again.Header.Get(idemhttp.ReplayedHeader))
	require.Equal(t, "/receipts/1", again.Header.Get("Location"), "the stored response's")
	require.Equal(t, int64(1), b.runs.Load())
	require.Equal(t, 1, b.receipts(t), "a stored 3xx commits the handler's writes, once")

	applied, err := b.m.Applied(context.Background(), "k1")
	require.False(t, applied)
	var rejected *idemhttp.RejectedError
	require.ErrorAs(t, err, &rejected)
	require.Equal(t, http.StatusSeeOther, rejected.Status)
	r := b.keyStatus(t, "k1")
	require.Equal(t, http.StatusConflict, r.status)
	require.JSONEq(t, `{"applied":false,"status":303}`, r.body)
}

// TestRefusalAfterAFailedStatement: a handler whose statement failed (the
// transaction is aborted, nothing of it can commit) and that then answers
// with a refusal gets that answer to the client, not stored, so a retry
// runs the handler again; one that answers 2xx after it gets 500, since its
// writes are gone.
func TestRefusalAfterAFailedStatement(t *testing.T) {
	t.Parallel()
	s, m := newMiddleware(t, idemhttp.Options{})
	var runs atomic.Int64
	var status atomic.Int64
	h := m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx, _ := idemhttp.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), `INSERT INTO receipt (body) VALUES ($1)`, nil); err == nil {
			t.Error("a NULL body was inserted")
		}
		w.WriteHeader(int(status.Load()))
		_, _ = w.Write([]byte(`{"error":"receipt rejected"}`))
	}))
	serve := func(key string) *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, "/receipts", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", key)
		h.ServeHTTP(rec, req)
		return rec
	}
	for _, code := range []int{http.StatusUnprocessableEntity, http.StatusBadRequest, http.StatusSeeOther} {
		status.Store(int64(code))
		before := runs.Load()
		for range 2 {
			rec := serve("refused-" + itoa(int64(code)))
			require.Equal(t, code, rec.Code, "the handler's answer, passed on")
			require.JSONEq(t, `{"error":"receipt rejected"}`, rec.Body.String())
			require.Empty(t, rec.Header().Get(idemhttp.ReplayedHeader))
		}
		require.Equal(t, before+2, runs.Load(), "not stored: the second request ran the handler again")
		applied, err := m.Applied(context.Background(), "refused-"+itoa(int64(code)))
		require.NoError(t, err, "the key is unknown, not rejected")
		require.False(t, applied)
	}
	status.Store(http.StatusCreated)
	rec := serve("created")
	require.Equal(t, http.StatusInternalServerError, rec.Code, "a success whose writes failed is not told as one")
	var markers int
	require.NoError(t, s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM dedup_marker`).Scan(&markers))
	require.Zero(t, markers)
}

// TestContentEncodingIsReplayed: a compressed first answer is replayed with
// its Content-Encoding, or the client could not read the stored bytes.
func TestContentEncodingIsReplayed(t *testing.T) {
	t.Parallel()
	_, m := newMiddleware(t, idemhttp.Options{})
	h := m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Encoding", "gzip")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte{0x1f, 0x8b})
	}))
	var got []*httptest.ResponseRecorder
	for range 2 {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k")
		h.ServeHTTP(rec, req)
		got = append(got, rec)
	}
	require.Equal(t, "true", got[1].Header().Get(idemhttp.ReplayedHeader))
	for _, rec := range got {
		require.Equal(t, "gzip", rec.Header().Get("Content-Encoding"))
		require.Equal(t, []byte{0x1f, 0x8b}, rec.Body.Bytes())
	}
}

// TestBodyOverAnOuterLimitIs413: a body over the limit of an
// http.MaxBytesHandler around the middleware gets 413, as one over
// MaxBodyBytes does, not 400; the handler never runs.
func TestBodyOverAnOuterLimitIs413(t *testing.T) {
	t.Parallel()
	_, m := newMiddleware(t, idemhttp.Options{})
	var runs atomic.Int64
	srv := httptest.NewServer(http.MaxBytesHandler(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})), 10))
	defer srv.Close()
	req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(strings.Repeat("x", 100)))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "k")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
	require.JSONEq(t, `{"error":"body larger than 10 bytes"}`, string(b), "worded as MaxBodyBytes's 413")
	require.Zero(t, runs.Load())
}

// TestResponseIsSentAsNetHTTPSendsIt: the first response carries the
// header as it was when the handler wrote its status (a header set later
// is not sent, and one set between a 103 and the status is), and the
// trailers after the body, declared or with http.TrailerPrefix, not as
// headers; a replay gives the same status, headers, body and trailers.
// Over HTTP/1.1 and HTTP/2, and with an undeclared trailer alone after a
// short body, which a replay sends too.
func TestResponseIsSentAsNetHTTPSendsIt(t *testing.T) {
	t.Parallel()
	handlers := map[string]struct {
		h       http.HandlerFunc
		trailer http.Header
	}{
		"declared": {func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Link", "</style.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints) // dropped: not the answer
			w.Header().Set("Trailer", "X-Sum")
			w.Header().Set("Content-Type", "text/plain")
			w.Header().Set("X-Early", "1")
			w.Header().Set(http.TrailerPrefix+"X-Known-Early", "e") // a trailer, though set before the status
			w.WriteHeader(http.StatusCreated)
			w.Header().Set("X-Late", "1") // net/http would not send it
			_, _ = w.Write([]byte("hello"))
			w.Header().Set("X-Sum", "5")
			w.Header().Set(http.TrailerPrefix+"X-Undeclared", "u")
		}, http.Header{"X-Sum": {"5"}, "X-Known-Early": {"e"}, "X-Undeclared": {"u"}}},
		"undeclared": {func(w http.ResponseWriter, r *http.Request) {
			_, _ = w.Write([]byte("hi"))
			w.Header().Set(http.TrailerPrefix+"X-Only", "o")
		}, http.Header{"X-Only": {"o"}}},
	}
	for name, c := range handlers {
		for _, h2 := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/h2=%v", name, h2), func(t *testing.T) {
				t.Parallel()
				_, m := newMiddleware(t, idemhttp.Options{ReplayHeaders: []string{"Content-Type", "Link", "X-Early", "X-Late", "X-Sum"}})
				var runs atomic.Int64
				srv := httptest.NewUnstartedServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					c.h(w, r)
				})))
				if h2 {
					srv.EnableHTTP2 = true
					srv.StartTLS()
				} else {
					srv.Start()
				}
				defer srv.Close()
				first := sendKeyed(t, srv)
				again := sendKeyed(t, srv)
				require.Equal(t, h2, first.proto == 2)
				require.Equal(t, c.trailer, first.trailer)
				require.Empty(t, first.header.Get(idemhttp.ReplayedHeader))
				if name == "declared" {
					require.Equal(t, http.StatusCreated, first.status)
					require.Equal(t, "hello", first.body)
					require.Equal(t, "1", first.header.Get("X-Early"))
					require.Equal(t, "text/plain", first.header.Get("Content-Type"))
					require.Empty(t, first.header.Get("X-Late"), "set after the status")
					require.Empty(t, first.header.Get("X-Sum"), "a trailer, not a header")
				}

				require.Equal(t, "true", again.header.Get(idemhttp.ReplayedHeader))
				again.header.Del(idemhttp.ReplayedHeader)
				require.Equal(t, first, again, "the replay is the first response")
				require.Equal(t, int64(1), runs.Load())
			})
		}
	}
}

// sent is a response as a client read it, without its Date.
type sent struct {
	proto            int
	status           int
	header, trailer  http.Header
	contentLength    int64
	transferEncoding []string
	body             string
}

// sendKeyed posts {} with the key "k" to srv.
func sendKeyed(t *testing.T, srv *httptest.Server) sent {
	t.Helper()
	return sendKeyedAs(t, srv, http.MethodPost)
}

// sendKeyedAs sends {} with the key "k" to srv by method.
func sendKeyedAs(t *testing.T, srv *httptest.Server, method string) sent {
	t.Helper()
	req, err := http.NewRequest(method, srv.URL, strings.NewReader("{}"))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "k")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Header.Del("Date")
	return sent{resp.ProtoMajor, resp.StatusCode, resp.Header, resp.Trailer, resp.ContentLength, resp.TransferEncoding, string(b)}
}

// TestBodilessResponsesAsNetHTTP: a HEAD answer's body is not sent, first
// or replayed, and both carry the same headers; a 204 refuses a body with
// http.ErrBodyNotAllowed, as net/http does; a status that is not three
// digits panics, as net/http's WriteHeader does, before anything commits.
func TestBodilessResponsesAsNetHTTP(t *testing.T) {
	t.Parallel()
	_, m := newMiddleware(t, idemhttp.Options{ReplayHeaders: []string{"Content-Type", "Content-Length"}})
	writeErr := make(chan error, 1) // the 204's Write; the replay does not run the handler
	srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodHead {
			w.Header().Set("Content-Type", "text/plain")
			_, _ = w.Write([]byte("hello"))
			return
		}
		w.WriteHeader(http.StatusNoContent)
		_, err := w.Write([]byte("x"))
		writeErr <- err
	})))
	defer srv.Close()
	send := func(method string) (*http.Response, string) {
		req, err := http.NewRequest(method, srv.URL, nil)
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", method)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		resp.Header.Del("Date")
		return resp, string(b)
	}
	first, body := send(http.MethodHead)
	require.Empty(t, body)
	again, body := send(http.MethodHead)
	require.Empty(t, body)
	require.Equal(t, "true", again.Header.Get(idemhttp.ReplayedHeader))
	again.Header.Del(idemhttp.ReplayedHeader)
	require.Equal(t, first.Header, again.Header)
	require.Equal(t, int64(5), first.ContentLength, "the length of the body the handler wrote, as net/http gives it")
	require.Equal(t, first.ContentLength, again.ContentLength)

	first, body = send(http.MethodPost)
	require.Equal(t, http.StatusNoContent, first.StatusCode)
	require.Empty(t, body)
	require.ErrorIs(t, <-writeErr, http.ErrBodyNotAllowed)
	again, body = send(http.MethodPost)
	require.Equal(t, "true", again.Header.Get(idemhttp.ReplayedHeader))
	require.Equal(t, http.StatusNoContent, again.StatusCode)
	require.Empty(t, body)

	bad := m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(42) }))
	req := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", "bad")
	require.PanicsWithValue(t, "invalid WriteHeader code 42", func() { bad.ServeHTTP(httptest.NewRecorder(), req) })
	applied, err := m.Applied(context.Background(), "bad")
	require.NoError(t, err)
	require.False(t, applied, "rolled back")
}

// TestResponseStoredWithoutTrailersReplays: a response stored in the shape
// it had before trailers were kept (no Trailer member) is replayed as it
// was, with no trailers.
func TestResponseStoredWithoutTrailersReplays(t *testing.T) {
	t.Parallel()
	_, m := newMiddleware(t, idemhttp.Options{})
	// The shapes idemhttp stores, as they were.
	type request struct{ Method, Path, Body string }
	type response struct {
		Status int
		Header http.Header
		Body   []byte
	}
	sum := sha256.Sum256([]byte("{}"))
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: idemhttp.Namespace, ActivityType: idemhttp.DefaultScope, Key: "k"}
	_, outcome, err := dedupactivity.Do(context.Background(), m.Deduper(), id, request{http.MethodPost, "/", hex.EncodeToString(sum[:])},
		func(context.Context, pgx.Tx, request) (response, error) {
			return response{http.StatusCreated, http.Header{"Content-Type": {"text/plain"}}, []byte("old")}, nil
		})
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)

	srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Error("the handler ran for a stored key")
	})))
	defer srv.Close()
	got := sendKeyed(t, srv)
	require.Equal(t, "true", got.header.Get(idemhttp.ReplayedHeader))
	require.Equal(t, http.StatusCreated, got.status)
	require.Equal(t, "text/plain", got.header.Get("Content-Type"))
	require.Equal(t, "old", got.body)
	require.Nil(t, got.trailer)
}

// TestTrailerNameAlsoAHeader: a trailer whose name is also a header set
// before the status (declared in Trailer, or set with http.TrailerPrefix)
// is sent, first and replayed, as net/http sends it: the header with its
// value at the status, the trailer once with its final value.
func TestTrailerNameAlsoAHeader(t *testing.T) {
	t.Parallel()
	for name, h := range map[string]http.HandlerFunc{
		"declared": func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Trailer", "X-Sum")
			w.Header().Set("X-Sum", "early")
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("body"))
			w.Header().Set("X-Sum", "final")
		},
		"prefixed": func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("X-Sum", "early")
			w.Header().Set(http.TrailerPrefix+"X-Sum", "x")
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("body"))
			w.Header().Set(http.TrailerPrefix+"X-Sum", "final")
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			direct := httptest.NewServer(h)
			defer direct.Close()
			want := sendKeyed(t, direct)
			require.Equal(t, []string{"early"}, want.header.Values("X-Sum"))
			require.Equal(t, []string{"final"}, want.trailer.Values("X-Sum"))

			_, m := newMiddleware(t, idemhttp.Options{ReplayHeaders: []string{"X-Sum"}})
			srv := httptest.NewServer(m.Handler(h))
			defer srv.Close()
			for _, which := range []string{"first", "replayed"} {
				got := sendKeyed(t, srv)
				require.Equal(t, want.header.Values("X-Sum"), got.header.Values("X-Sum"), which)
				require.Equal(t, want.trailer, got.trailer, which)
			}
		})
	}
}

// TestHandlerSeesTheHeadersSetBeforeIt: a header that a middleware around
// this one set before calling it (a CORS middleware's Vary: Origin) is in
// the handler's header, as net/http gives it: a handler that adds a value
// to it sends both, first as without the middleware. Before, the handler
// started from an empty header, and its Add replaced the outer value.
func TestHandlerSeesTheHeadersSetBeforeIt(t *testing.T) {
	t.Parallel()
	var n atomic.Int64
	outer := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Add("Vary", "Origin")
			w.Header().Set("X-Request-Id", itoa(n.Add(1)))
			h.ServeHTTP(w, r)
		})
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Add("Vary", "Accept-Encoding")
		w.WriteHeader(http.StatusCreated)
	})
	direct := httptest.NewServer(outer(h))
	defer direct.Close()
	want := sendKeyed(t, direct)
	require.Equal(t, []string{"Origin", "Accept-Encoding"}, want.header.Values("Vary"))

	_, m := newMiddleware(t, idemhttp.Options{ReplayHeaders: []string{"Vary", "X-Request-Id"}})
	srv := httptest.NewServer(outer(m.Handler(h)))
	defer srv.Close()
	got := sendKeyed(t, srv)
	require.Equal(t, http.StatusCreated, got.status)
	require.Equal(t, want.header.Values("Vary"), got.header.Values("Vary"))
	again := sendKeyed(t, srv)
	require.Equal(t, "true", again.header.Get(idemhttp.ReplayedHeader))
	require.Equal(t, want.header.Values("Vary"), again.header.Values("Vary"))
	require.Equal(t, itoa(n.Load()), again.header.Get("X-Request-Id"), "an outer header the handler left is the outer's own, not stored")
}

// TestHandlerDeletesAHeaderSetBeforeIt: a header that a middleware around
// this one set and the handler deleted is not sent, as net/http does not
// send it; it went out on the first response (and on an answer passed on
// unstored) from the outer map, which the middleware wrote the handler's
// header onto.
func TestHandlerDeletesAHeaderSetBeforeIt(t *testing.T) {
	t.Parallel()
	var status atomic.Int64
	outer := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Cache-Control", "no-store")
			h.ServeHTTP(w, r)
		})
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Del("Cache-Control")
		w.WriteHeader(int(status.Load()))
	})
	direct := httptest.NewServer(outer(h))
	defer direct.Close()
	_, m := newMiddleware(t, idemhttp.Options{})
	srv := httptest.NewServer(outer(m.Handler(h)))
	defer srv.Close()
	for _, code := range []int{http.StatusServiceUnavailable, http.StatusCreated} {
		status.Store(int64(code))
		want := sendKeyed(t, direct)
		require.Empty(t, want.header.Values("Cache-Control"))
		got := sendKeyed(t, srv)
		require.Equal(t, code, got.status)
		require.Equal(t, want.header.Values("Cache-Control"), got.header.Values("Cache-Control"), "%d", code)
	}
}

// TestLargeBodyIsCutAtTheStorableSize: a body that cannot be stored (above
// Dedup.MaxResultBytes, which holds it base64-encoded) is refused as it is
// written, so a handler that streams a large answer is not buffered whole
// before its 500: its Write fails past the limit, and its insert rolls back.
func TestLargeBodyIsCutAtTheStorableSize(t *testing.T) {
	t.Parallel()
	const limit = 64 << 10
	var logged bytes.Buffer
	s, m := newMiddleware(t, idemhttp.Options{Dedup: dedupactivity.Options{MaxResultBytes: limit},
		Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	var written atomic.Int64
	var writeErr atomic.Value
	srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idemhttp.Tx(r.Context())
		_, err := tx.Exec(r.Context(), `INSERT INTO receipt (body) VALUES ('x')`)
		require.NoError(t, err)
		chunk := bytes.Repeat([]byte("x"), 32<<10)
		for written.Load() < 64<<20 { // a 64 MiB download
			n, err := w.Write(chunk)
			written.Add(int64(n))
			if err != nil {
				writeErr.Store(err)
				return
			}
		}
	})))
	t.Cleanup(srv.Close)
	b := &testBundle{schema: s, m: m, srv: srv}
	r := b.post(t, "/", "k", "")
	require.Equal(t, http.StatusInternalServerError, r.status)
	require.JSONEq(t, `{"error":"internal error"}`, r.body)
	require.LessOrEqual(t, written.Load(), int64(limit), "the body is not buffered past what can be stored")
	require.NotNil(t, writeErr.Load(), "the handler's Write fails once the body cannot be stored")
	require.ErrorIs(t, writeErr.Load().(error), dedupactivity.ErrResultTooLarge, "a handler can tell why")
	require.Contains(t, logged.String(), "too large")
	require.Zero(t, b.receipts(t), "rolled back")
}

// TestRawBytesOfTheTargetAreTheRequest: a request target may carry bytes
// that are not UTF-8 (net/http takes them raw into the query), which the
// fingerprint's JSON would turn into U+FFFD: two targets that differ only
// by them are two requests, so the second gets 422, not the first's answer.
func TestRawBytesOfTheTargetAreTheRequest(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	send := func(query string) string {
		c, err := net.Dial("tcp", b.srv.Listener.Addr().String())
		require.NoError(t, err)
		defer c.Close()
		_, err = io.WriteString(c, "POST /receipts?to="+query+" HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\r\n"+
			"Content-Length: 0\r\nConnection: close\r\n\r\n")
		require.NoError(t, err)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		require.NoError(t, err)
		defer resp.Body.Close()
		return resp.Status
	}
	require.Equal(t, "201 Created", send("\xff"))
	require.Equal(t, "422 Unprocessable Entity", send("\xfe"), "another target")
	require.Equal(t, "201 Created", send("\xff"), "the same target is replayed")
	require.Equal(t, 1, b.receipts(t))
}

// lockedBuffer is a bytes.Buffer that a server goroutine writes while the
// test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestClientGoneIsNotAnError: a client that goes away while its request
// runs leaves nothing committed and is logged as a warning, not as an
// error (nothing is wrong with the service); the same key then runs again.
func TestClientGoneIsNotAnError(t *testing.T) {
	t.Parallel()
	var logged lockedBuffer
	s, m := newMiddleware(t, idemhttp.Options{Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	var runs atomic.Int64
	entered := make(chan struct{}, 1)
	srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idemhttp.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), `INSERT INTO receipt (body) VALUES ('gone')`); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if runs.Add(1) == 1 {
			entered <- struct{}{}
			<-r.Context().Done() // the server has seen the client go
		}
		w.WriteHeader(http.StatusCreated)
	})))
	t.Cleanup(srv.Close)
	post := func(ctx context.Context) (*http.Response, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "gone")
		return srv.Client().Do(req)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		resp, err := post(ctx)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	<-entered
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	require.Eventually(t, func() bool { return strings.Contains(logged.String(), "idemhttp:") }, 10*time.Second, 10*time.Millisecond)
	require.NotContains(t, logged.String(), "level=ERROR", logged.String())
	require.Contains(t, logged.String(), "level=WARN")

	var n int
	require.NoError(t, s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM receipt`).Scan(&n))
	require.Zero(t, n, "nothing committed for a client that went away")
	resp, err := post(context.Background())
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode, "the key runs again")
	require.Equal(t, int64(2), runs.Load())
}

// TestLargeBodyOfAnAnswerNotStoredPassesOn: a status that is not stored
// (5xx, 408, 409, 425, 429) is passed on to the client as the handler wrote
// it, body and all: the store's size bound is for what is stored, so it
// does not turn the handler's 503 into the middleware's 500.
func TestLargeBodyOfAnAnswerNotStoredPassesOn(t *testing.T) {
	t.Parallel()
	const limit = 64 << 10
	s, m := newMiddleware(t, idemhttp.Options{Dedup: dedupactivity.Options{MaxResultBytes: limit}})
	page := strings.Repeat("x", 2*limit)
	srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(w, page)
	})))
	t.Cleanup(srv.Close)
	b := &testBundle{schema: s, m: m, srv: srv}
	r := b.post(t, "/", "k", "")
	require.Equal(t, http.StatusServiceUnavailable, r.status, r.body[:min(len(r.body), 100)])
	require.Equal(t, page, r.body)
}

// TestServerFailureWhileTheClientLeftIsAnError: a 500 whose cause is the
// service's (here a body too large to store), not the ended context, is
// logged at ERROR even when the client went away meanwhile.
func TestServerFailureWhileTheClientLeftIsAnError(t *testing.T) {
	t.Parallel()
	const limit = 64 << 10
	var logged lockedBuffer
	_, m := newMiddleware(t, idemhttp.Options{Dedup: dedupactivity.Options{MaxResultBytes: limit},
		Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write(bytes.Repeat([]byte("x"), 2*limit))
		cancel() // the client gives up on the download
	}))
	req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/", nil)
	req.Header.Set("Idempotency-Key", "k")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	require.Equal(t, http.StatusInternalServerError, rec.Code)
	require.Contains(t, logged.String(), "too large")
	require.Contains(t, logged.String(), "level=ERROR", logged.String())
}

// TestKeyOfMaxKeyLengthIsAccepted pins the bound of a key at
// MaxKeyLength (255 bytes) inclusive: the longest key the outbox enqueues
// and sends (its Message.Key limit) is applied, once, and replayed; only a
// longer one is refused with 400. Applied rows are counted by SQL.
func TestKeyOfMaxKeyLengthIsAccepted(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	key := strings.Repeat("k", idemhttp.MaxKeyLength)
	require.Equal(t, http.StatusCreated, b.post(t, "/receipts", key, `{}`).status)
	again := b.post(t, "/receipts", key, `{}`)
	require.Equal(t, http.StatusCreated, again.status)
	require.Equal(t, "true", again.header.Get(idemhttp.ReplayedHeader))
	require.Equal(t, 1, b.receipts(t))
	require.Equal(t, http.StatusBadRequest, b.post(t, "/receipts", key+"k", `{}`).status)
	require.Equal(t, 1, b.receipts(t))
}

// TestSameKeyOtherMethodIs422 pins the method in a key's fingerprint: the
// same key, path and body with another method is another request, 422,
// whose handler does not run (a PUT replayed a POST's stored answer
// without it). The handler's rows are counted by SQL.
func TestSameKeyOtherMethodIs422(t *testing.T) {
	t.Parallel()
	s, m := newMiddleware(t, idemhttp.Options{})
	h := m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idemhttp.Tx(r.Context())
		if _, err := tx.Exec(r.Context(), `INSERT INTO receipt (body) VALUES ($1)`, r.Method); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	send := func(method string) int {
		req, err := http.NewRequest(method, srv.URL+"/receipts/1", strings.NewReader(`{"amount":5}`))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "k1")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusCreated, send(http.MethodPost))
	require.Equal(t, http.StatusUnprocessableEntity, send(http.MethodPut))
	var n int
	require.NoError(t, s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM receipt`).Scan(&n))
	require.Equal(t, 1, n, "the PUT ran nothing")
}

// TestInFlightWaitBoundsTheWait pins InFlightWait as the bound of a
// request's wait for the same key's first request (it becomes the claim's
// ClaimWait): 200ms given, and 1s by default, not dedupactivity's own 10s
// default. The second request gets its 409 after it waited, well before
// 10s; the first, released after, applies once (by SQL).
func TestInFlightWaitBoundsTheWait(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		opts  idemhttp.Options
		bound time.Duration
	}{
		"given":   {idemhttp.Options{InFlightWait: 200 * time.Millisecond}, 3 * time.Second},
		"default": {idemhttp.Options{}, 5 * time.Second},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, c.opts)
			b.gate = make(chan struct{})
			release := sync.OnceFunc(func() { close(b.gate) })
			t.Cleanup(release) // before the server's Close, which waits for the first request
			firstDone := make(chan reply, 1)
			go func() { firstDone <- b.post(t, "/receipts", "k1", `{}`) }()
			<-b.entered
			start := time.Now()
			second := b.post(t, "/receipts", "k1", `{}`)
			waited := time.Since(start)
			require.Equal(t, http.StatusConflict, second.status)
			require.Less(t, waited, c.bound, "bounded by InFlightWait, not the claim's 10s default")
			require.GreaterOrEqual(t, waited, 100*time.Millisecond, "it waited")
			release()
			require.Equal(t, http.StatusCreated, (<-firstDone).status)
			require.Equal(t, 1, b.receipts(t))
		})
	}
}

// TestReplayKeepsHeaderBytes: a replayed header's value is the bytes the
// handler sent, also when they are not UTF-8 (HTTP allows obs-text, such
// as a Latin-1 filename), which the stored JSON would turn into U+FFFD;
// so are the body's bytes and a trailer's. Read from the wire by a client.
func TestReplayKeepsHeaderBytes(t *testing.T) {
	t.Parallel()
	_, m := newMiddleware(t, idemhttp.Options{ReplayHeaders: []string{"Content-Disposition", "X-Sum"}})
	const disposition = "attachment; filename=\"caf\xe9.txt\""
	srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Disposition", disposition)
		w.Header().Set("Trailer", "X-Sum")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("\xff\xfe body"))
		w.Header().Set("X-Sum", "\xe9")
	})))
	t.Cleanup(srv.Close)
	for i := range 2 {
		got := sendKeyed(t, srv)
		require.Equal(t, http.StatusCreated, got.status)
		require.Equal(t, disposition, got.header.Get("Content-Disposition"), "delivery %d", i+1)
		require.Equal(t, "\xff\xfe body", got.body, "delivery %d", i+1)
		require.Equal(t, "\xe9", got.trailer.Get("X-Sum"), "delivery %d", i+1)
		require.Equal(t, i == 1, got.header.Get(idemhttp.ReplayedHeader) == "true", "delivery %d", i+1)
	}
}

// TestMiddlewareNotMadeByNewPanics: Handler and StatusHandler of a
// Middleware that New did not make panic when they are built. A zero
// Middleware has no key header, so its Handler passed every request on
// without a transaction, the same key applied as often as it came; a nil
// one panicked on each request instead. The rows are counted by SQL.
func TestMiddlewareNotMadeByNewPanics(t *testing.T) {
	t.Parallel()
	s, m := newMiddleware(t, idemhttp.Options{})
	insert := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, ok := idemhttp.Tx(r.Context()); !ok {
			_, _ = s.Pool.Exec(r.Context(), `INSERT INTO receipt (body) VALUES ('unprotected')`)
		}
		w.WriteHeader(http.StatusCreated)
	})
	const msg = "idemhttp: the Middleware was not made by New"
	for name, bad := range map[string]*idemhttp.Middleware{"zero": {}, "nil": nil} {
		assert.PanicsWithValue(t, msg, func() { bad.StatusHandler() }, name)
		var h http.Handler
		if !assert.PanicsWithValue(t, msg, func() { h = bad.Handler(insert) }, name) && name == "zero" {
			srv := httptest.NewServer(h)
			b := &testBundle{schema: s, srv: srv}
			b.post(t, "/", "k", "{}")
			b.post(t, "/", "k", "{}")
			srv.Close()
		}
	}
	var n int
	require.NoError(t, s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM receipt`).Scan(&n))
	require.Zero(t, n, "no request ran unprotected")
	require.Panics(t, func() { m.Handler(nil) }, "a nil handler")
}

// TestKeyHeaderMustBeAHeaderName: New refuses a KeyHeader that is not a
// valid header name, which no request can carry: with it, every request
// passed on without a key, its writes outside any transaction.
func TestKeyHeaderMustBeAHeaderName(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	for _, name := range []string{"Idempotency Key", "Idempotency-Key:", "Idempotency-Key\n", "Clé"} {
		_, err := idemhttp.New(s.Pool, idemhttp.Options{KeyHeader: name})
		require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions, "%q", name)
		require.ErrorContains(t, err, "KeyHeader")
	}
	_, err := idemhttp.New(s.Pool, idemhttp.Options{KeyHeader: "x-request-key"})
	require.NoError(t, err, "any case")
}

// TestClaimWaitIsInFlightWait: New refuses a Dedup.ClaimWait other than
// InFlightWait, which sets it: another value would be replaced by
// InFlightWait (1s by default) without a word.
func TestClaimWaitIsInFlightWait(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	for _, opts := range []idemhttp.Options{
		{Dedup: dedupactivity.Options{ClaimWait: 3 * time.Second}},
		{InFlightWait: 2 * time.Second, Dedup: dedupactivity.Options{ClaimWait: 3 * time.Second}},
	} {
		_, err := idemhttp.New(s.Pool, opts)
		require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
		require.ErrorContains(t, err, "Dedup.ClaimWait")
	}
	_, err := idemhttp.New(s.Pool, idemhttp.Options{InFlightWait: 3 * time.Second, Dedup: dedupactivity.Options{ClaimWait: 3 * time.Second}})
	require.NoError(t, err, "the same wait twice")
}

// TestKeyIsTheHeaderValueOverBothProtocols: a key sent with spaces or tabs
// around it is one key over HTTP/1.1, where net/http trims them, and over
// HTTP/2, where it keeps them: one request sent over both applies once (by
// SQL) and the second gets the replay; StatusHandler and Applied answer
// for it either way. Before, HTTP/2 gave " k\t" a key of its own, and the
// request was applied twice.
func TestKeyIsTheHeaderValueOverBothProtocols(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	h2 := httptest.NewUnstartedServer(b.srv.Config.Handler)
	h2.EnableHTTP2 = true
	h2.StartTLS()
	t.Cleanup(h2.Close)
	send := func(srv *httptest.Server, key string) (int, string, int) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/receipts", strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader), resp.ProtoMajor
	}
	status, replayed, proto := send(h2, " k\t")
	require.Equal(t, 2, proto)
	require.Equal(t, http.StatusCreated, status)
	require.Empty(t, replayed)
	status, replayed, proto = send(b.srv, "k")
	require.Equal(t, 1, proto)
	require.Equal(t, http.StatusCreated, status)
	assert.Equal(t, "true", replayed, "the same key")
	status, replayed, _ = send(h2, "k ")
	assert.Equal(t, "true", replayed, "the same key over HTTP/2 too")
	require.Equal(t, http.StatusCreated, status)
	require.Equal(t, 1, b.receipts(t))
	require.Equal(t, int64(1), b.runs.Load())

	applied, err := b.m.Applied(context.Background(), " k ")
	require.NoError(t, err)
	require.True(t, applied)
	require.Equal(t, http.StatusOK, b.keyStatus(t, "k").status)
	r := b.post(t, "/receipts", " \t ", `{}`)
	require.Equal(t, http.StatusAccepted, r.status, "blanks alone are no key")
}

// A request's key header may come on several lines: blank ones carry no
// key, the same key twice is that key, and two different keys are refused
// before anything runs.
func TestKeyOnSeveralHeaderLines(t *testing.T) {
	t.Parallel()
	b := setup(t, idemhttp.Options{})
	keys := func(vs ...string) http.Header { return http.Header{"Idempotency-Key": vs} }

	r := b.do(t, http.MethodPost, "/receipts", keys("", "k"), `{}`)
	require.Equal(t, http.StatusCreated, r.status, r.body)
	require.Empty(t, r.header.Get(idemhttp.ReplayedHeader))
	r = b.do(t, http.MethodPost, "/receipts", keys("k", " k"), `{}`)
	require.Equal(t, http.StatusCreated, r.status, r.body)
	require.Equal(t, "true", r.header.Get(idemhttp.ReplayedHeader), "the key of the blank line and the key's is k")
	r = b.post(t, "/receipts", "k", `{}`)
	require.Equal(t, "true", r.header.Get(idemhttp.ReplayedHeader))

	r = b.do(t, http.MethodPost, "/receipts", keys("a", "b"), `{}`)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Contains(t, r.body, "more than one Idempotency-Key header")
	r = b.do(t, http.MethodPost, "/receipts", keys("", "k", "b"), `{}`)
	require.Equal(t, http.StatusBadRequest, r.status)
	r = b.post(t, "/receipts", "a", `{}`)
	require.Equal(t, http.StatusCreated, r.status)
	require.Empty(t, r.header.Get(idemhttp.ReplayedHeader), "the refused request claimed nothing")

	require.Equal(t, 2, b.receipts(t), "k and a, once each")
	require.Equal(t, int64(2), b.runs.Load())
}

// TestBodyReadTimeoutIs408: a body the server stopped waiting for (its
// ReadTimeout) gets 408, which a client retries (the outbox's HTTPSender
// among them), not the 400 of a malformed body, which it takes as refused
// for good; nothing runs either way.
func TestBodyReadTimeoutIs408(t *testing.T) {
	t.Parallel()
	_, m := newMiddleware(t, idemhttp.Options{})
	var runs atomic.Int64
	srv := httptest.NewUnstartedServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})))
	srv.Config.ReadTimeout = 300 * time.Millisecond
	srv.Start()
	defer srv.Close()

	send := func(t *testing.T, request string) int {
		conn, err := net.Dial("tcp", srv.Listener.Addr().String())
		require.NoError(t, err)
		defer conn.Close()
		_, err = io.WriteString(conn, request)
		require.NoError(t, err)
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		require.NoError(t, err)
		resp.Body.Close()
		return resp.StatusCode
	}
	head := "POST / HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\r\n"
	t.Run("Stalled", func(t *testing.T) {
		// Half the body, then nothing until the server times the read out.
		assert.Equal(t, http.StatusRequestTimeout, send(t, head+"Content-Length: 10\r\n\r\nxxxxx"))
	})
	t.Run("Malformed", func(t *testing.T) {
		assert.Equal(t, http.StatusBadRequest, send(t, head+"Transfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n0\r\n\r\n"))
	})
	assert.Zero(t, runs.Load())
}

// TestTimeoutHandlerOutside: with an http.TimeoutHandler around the
// middleware, a slow request's client gets the 503 and the request's
// context is cancelled, so whatever the handler writes after is rolled
// back with the key (the claim runs under that context): the client's
// retry with the key runs the handler again, and its effect is applied
// once.
func TestTimeoutHandlerOutside(t *testing.T) {
	t.Parallel()
	s, m := newMiddleware(t, idemhttp.Options{InFlightWait: 5 * time.Second})
	proceed := make(chan struct{})
	var runs atomic.Int64
	srv := httptest.NewServer(http.TimeoutHandler(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := idemhttp.Tx(r.Context())
		if !ok {
			http.Error(w, "no key", http.StatusBadRequest)
			return
		}
		if runs.Add(1) == 1 {
			<-proceed // past the timeout
		}
		if _, err := tx.Exec(context.Background(), `INSERT INTO receipt (body) VALUES ('x')`); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})), 200*time.Millisecond, "too slow"))
	defer srv.Close()
	b := &testBundle{schema: s, m: m, srv: srv}

	first := b.post(t, "/", "k", "x")
	require.Equal(t, http.StatusServiceUnavailable, first.status)
	close(proceed)
	second := b.post(t, "/", "k", "x") // waits for the first, still running, to end
	require.Equal(t, http.StatusCreated, second.status)
	require.Empty(t, second.header.Get("Idempotent-Replayed"), "the timed-out request stored nothing")
	require.EqualValues(t, 2, runs.Load())
	require.Equal(t, 1, b.receipts(t), "the timed-out request's insert rolled back")
}

// TestTimeoutHandlerInside: with an http.TimeoutHandler inside the
// middleware, the client gets its 503 while the handler goes on in a
// goroutine of its own. What that goroutine then calls on the request's Tx
// fails with pgx.ErrTxClosed, and a call in flight when the request ends is
// waited for (the TimeoutHandler's context cancels it), instead of reaching
// the connection while the middleware rolls it back: under the race
// detector, either would be reported as a race. Nothing the timed-out
// request wrote commits, and the retry with its key runs the handler again.
func TestTimeoutHandlerInside(t *testing.T) {
	t.Parallel()
	const insert = `INSERT INTO receipt (body) VALUES ('x')`
	// serve serves h behind the middleware, in a TimeoutHandler of 200ms
	// inside it.
	serve := func(t *testing.T, h http.HandlerFunc) *testBundle {
		s, m := newMiddleware(t, idemhttp.Options{})
		srv := httptest.NewServer(m.Handler(http.TimeoutHandler(h, 200*time.Millisecond, "too slow")))
		t.Cleanup(srv.Close)
		return &testBundle{schema: s, m: m, srv: srv}
	}
	t.Run("CallsAfterTheAnswer", func(t *testing.T) {
		t.Parallel()
		proceed := make(chan struct{})
		late := make(chan []error, 1)
		var runs atomic.Int64
		b := serve(t, func(w http.ResponseWriter, r *http.Request) {
			tx, _ := idemhttp.Tx(r.Context())
			ctx := context.Background()
			if _, err := tx.Exec(ctx, insert); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if runs.Add(1) == 1 {
				<-proceed // the client has had its 503
				var errs []error
				_, err := tx.Exec(ctx, insert)
				errs = append(errs, err)
				_, err = tx.Query(ctx, `SELECT 1`)
				errs = append(errs, err)
				var n int
				errs = append(errs, tx.QueryRow(ctx, `SELECT 1`).Scan(&n))
				errs = append(errs, tx.SendBatch(ctx, &pgx.Batch{QueuedQueries: []*pgx.QueuedQuery{{SQL: insert}}}).Close())
				_, err = tx.Begin(ctx)
				errs = append(errs, err)
				late <- errs
				return
			}
			w.WriteHeader(http.StatusCreated)
		})

		require.Equal(t, http.StatusServiceUnavailable, b.post(t, "/", "k", "x").status)
		close(proceed)
		for i, err := range <-late {
			require.ErrorIs(t, err, pgx.ErrTxClosed, "call %d after the answer", i)
		}
		require.Zero(t, b.receipts(t), "the timed-out request's insert rolled back")
		second := b.post(t, "/", "k", "x")
		require.Equal(t, http.StatusCreated, second.status)
		require.Empty(t, second.header.Get("Idempotent-Replayed"), "the timed-out request stored nothing")
		require.Equal(t, 1, b.receipts(t))
	})
	t.Run("CallInFlight", func(t *testing.T) {
		t.Parallel()
		slept := make(chan error, 1)
		b := serve(t, func(w http.ResponseWriter, r *http.Request) {
			tx, _ := idemhttp.Tx(r.Context())
			if _, err := tx.Exec(r.Context(), insert); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			_, err := tx.Exec(r.Context(), `SELECT pg_sleep(30)`)
			slept <- err
		})

		start := time.Now()
		require.Equal(t, http.StatusServiceUnavailable, b.post(t, "/", "k", "x").status)
		require.Less(t, time.Since(start), 20*time.Second, "the sleep was cancelled, not waited out")
		select {
		case err := <-slept:
			require.ErrorIs(t, err, context.DeadlineExceeded, "the sleep ended by the TimeoutHandler's context")
		case <-time.After(10 * time.Second):
			t.Fatal("the handler's statement did not end")
		}
		require.Zero(t, b.receipts(t))
	})
	t.Run("CallInFlightWithAnotherContext", func(t *testing.T) {
		// A call the timeout does not cancel holds the 503 until it ends,
		// and the handler's next call, made at once, is refused: the
		// request was over while the first one ran.
		t.Parallel()
		calls := make(chan error, 2)
		b := serve(t, func(w http.ResponseWriter, r *http.Request) {
			tx, _ := idemhttp.Tx(r.Context())
			ctx := context.Background()
			if _, err := tx.Exec(ctx, insert); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			_, err := tx.Exec(ctx, `SELECT pg_sleep(1)`)
			calls <- err
			_, err = tx.Exec(ctx, `SELECT pg_sleep(5)`)
			calls <- err
		})

		start := time.Now()
		require.Equal(t, http.StatusServiceUnavailable, b.post(t, "/", "k", "x").status)
		took := time.Since(start)
		require.GreaterOrEqual(t, took, time.Second, "the 503 waited for the call in flight")
		require.Less(t, took, 4*time.Second, "the 503 did not wait for the next call")
		require.NoError(t, <-calls, "the call in flight ran to its end")
		require.ErrorIs(t, <-calls, pgx.ErrTxClosed)
		require.Zero(t, b.receipts(t))
	})
	t.Run("CallbackCallingTheTx", func(t *testing.T) {
		// A call from inside another (a Batch's callback) is refused as
		// pgx refuses a busy connection, and does not wait for it.
		t.Parallel()
		s, m := newMiddleware(t, idemhttp.Options{})
		var inner error
		var conn *pgx.Conn
		srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tx, _ := idemhttp.Tx(r.Context())
			batch := &pgx.Batch{}
			batch.Queue(insert).Exec(func(pgconn.CommandTag) error {
				_, inner = tx.Exec(r.Context(), insert)
				conn = tx.Conn() // given, as pgx gives it there
				return nil
			})
			if err := tx.SendBatch(r.Context(), batch).Close(); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})))
		defer srv.Close()
		b := &testBundle{schema: s, m: m, srv: srv}
		require.Equal(t, http.StatusCreated, b.post(t, "/", "k", "x").status)
		require.ErrorContains(t, inner, "conn busy")
		require.NotNil(t, conn)
		require.Equal(t, 1, b.receipts(t))
	})
}
