package idemhttp_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity/idemhttp"
)

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
