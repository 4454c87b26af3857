package idemhttp_test

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity/idemhttp"
)

// TestReplayIsTheFirstResponse: a replay sends what the first response sent,
// as a client reads it (status, headers, framing, body), for handlers that
// set headers in ways net/http allows: a name set as a map key in another
// spelling than the canonical one, a nil Content-Type (no sniffing), and
// their own Content-Length (http.ServeContent, for HEAD and for a body
// over net/http's 2 KiB buffer, which is otherwise sent chunked). With
// ServeContent's Accept-Ranges among the ReplayHeaders, only the Date and
// Idempotent-Replayed headers differ.
func TestReplayIsTheFirstResponse(t *testing.T) {
	t.Parallel()
	content := bytes.Repeat([]byte("a"), 4096)
	for name, c := range map[string]struct {
		method  string
		handler http.HandlerFunc
	}{
		"non-canonical key": {http.MethodPost, func(w http.ResponseWriter, r *http.Request) {
			w.Header()["ETag"] = []string{`"v1"`}
			w.Header().Set("Content-Type", "text/plain")
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("ok"))
		}},
		"nil content type": {http.MethodPost, func(w http.ResponseWriter, r *http.Request) {
			w.Header()["Content-Type"] = nil
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("<html><body>hi</body></html>"))
		}},
		"HEAD with its content length": {http.MethodHead, func(w http.ResponseWriter, r *http.Request) {
			http.ServeContent(w, r, "a.txt", time.Time{}, bytes.NewReader(content[:100]))
		}},
		"content length over 2 KiB": {http.MethodGet, func(w http.ResponseWriter, r *http.Request) {
			http.ServeContent(w, r, "a.txt", time.Time{}, bytes.NewReader(content))
		}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, m := newMiddleware(t, idemhttp.Options{ReplayHeaders: []string{"Content-Type", "Content-Encoding", "Location", "ETag", "Accept-Ranges"}})
			srv := httptest.NewServer(m.Handler(c.handler))
			t.Cleanup(srv.Close)
			first := sendKeyedAs(t, srv, c.method)
			again := sendKeyedAs(t, srv, c.method)
			require.Equal(t, "true", again.header.Get(idemhttp.ReplayedHeader))
			again.header.Del(idemhttp.ReplayedHeader)
			require.Equal(t, first, again)
		})
	}
}
