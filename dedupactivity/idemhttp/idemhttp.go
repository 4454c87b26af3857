// Package idemhttp deduplicates HTTP requests by their Idempotency-Key
// header, for services that receive effects from an outbox (or any client
// that retries). It is built on dedupactivity's claim: the handler's
// database writes and the key's marker commit in one PostgreSQL
// transaction, so a request is applied once per key however often it
// arrives.
//
// The behaviour follows Stripe's idempotent requests:
//
//   - The first request with a key runs the handler inside a transaction
//     (Tx gives it the pgx.Tx). A response below 500, other than 408, 409,
//     425 and 429, commits the handler's writes and is stored: status, the
//     headers named in Options.ReplayHeaders, the body and the trailers.
//     It is sent as net/http would send it: with the headers as they were
//     when the handler wrote its status (one set later is not sent), and
//     the trailers (declared in the Trailer header, or set with
//     http.TrailerPrefix) after the body.
//   - A later request with the same key and the same method, path and body
//     gets the stored response without running the handler, with the header
//     Idempotent-Replayed: true: the same status, stored headers, body and
//     trailers.
//   - The same key with a different method, path or body gets 422
//     Unprocessable Entity; nothing runs.
//   - While the first request with a key is still running, a second one
//     waits for it, at most Options.InFlightWait (default 1s): if the first
//     finishes in time, the second gets its stored response; otherwise 409
//     Conflict with Retry-After, and the client retries later.
//   - A response of 500 or more, or a 408, 409, 425 or 429 (answers that
//     ask the client to retry), rolls the handler's writes back and is not
//     stored: the next request with the key runs the handler again.
//   - So is a 3xx or 4xx given after a statement of the handler failed
//     (the transaction is aborted: nothing of it can commit, the key's
//     marker included); a 2xx given then is a 500, as the handler's writes
//     are gone.
//   - A request without a key is passed to the handler without a
//     transaction (Tx returns false), or refused with 400 when
//     Options.RequireKey is set. One that carries two different keys (two
//     header lines) is refused with 400; nothing runs.
//   - A keyed request whose body cannot be read gets 400 when it is
//     malformed, 413 over Options.MaxBodyBytes, and 408 when the server
//     stopped waiting for it (its ReadTimeout), which a client retries;
//     nothing runs.
//
// A key is the header's value without the spaces and tabs around it, as
// HTTP defines a field's value (net/http trims them over HTTP/1.1 only), at
// most MaxKeyLength bytes. Keys are kept as long as the markers' retention
// (dedupactivity Options.Retention, default 30 days); Deduper.Prune removes
// them.
//
// Keys are one per Scope, whoever sends them, unless Options.Caller names
// the client each request comes from: then, as Stripe keeps keys per
// account, each caller has keys of its own, and a named caller never gets
// another's stored answer.
//
// Limits:
//   - The response is buffered and stored with the marker: a body above
//     about 1.5 MiB (Dedup.MaxResultBytes, 2 MiB by default, holds it
//     base64-encoded) fails with 500 and rolls back. With the default
//     Dedup.DataConverter, the handler's Write fails once the body is over
//     MaxResultBytes, so a larger one is not buffered whole (under a status
//     that is stored: a 5xx, 408, 409, 425 or 429 is passed on whole). Streaming
//     (Flusher, Hijacker) is not available to a handler behind the
//     middleware, nor are http.ResponseController's deadlines and full
//     duplex (ErrNotSupported), and informational 1xx answers are dropped
//     (101 Switching Protocols too, which needs Hijack).
//   - An http.TimeoutHandler may go around the middleware or inside it.
//     Either way a request that runs out of time gets 503 and its writes
//     roll back with its key, so the client's retry runs the handler
//     again. Around it, the timeout cancels the request's context, which
//     the claim runs under (TestTimeoutHandlerOutside). Inside it, the
//     503 is a status that is not stored; the handler goes on in a
//     goroutine of its own, and what it calls on the Tx from then on
//     fails with pgx.ErrTxClosed. A call in flight at the timeout is
//     waited for before the rollback (TestTimeoutHandlerInside): made
//     with the request's context, it is cancelled with it; made with
//     another, it holds the 503 until it ends.
//   - A replay is the stored response whatever the retry's Accept or
//     Accept-Encoding says. Put a compressing (or content-negotiating)
//     middleware outside this one, where it encodes each answer for its
//     own request; inside, a gzip body stored for one client would be
//     replayed to another that did not ask for it.
//   - A stored 3xx or 4xx commits the handler's writes too, while Applied
//     reports the key refused: a handler should write only when it answers
//     2xx.
//   - Turning Options.Caller on, or a change in what it returns for a
//     client, gives that client's keys new identities: a request sent again
//     after the change is applied again.
//
// Middleware.Applied and Middleware.StatusHandler answer "did you apply key
// K?" for an outbox Reconciler: applied (a stored 2xx), not applied (no
// key), or refused for good (a stored 3xx or 4xx; see RejectedError).
package idemhttp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/net/http/httpguts"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/txguard"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
)

// maxInFlightWait is the longest InFlightWait: dedupactivity's bound on the
// ClaimWait it becomes.
const maxInFlightWait = 24 * time.Hour

// Defaults of Options.
const (
	DefaultKeyHeader    = "Idempotency-Key"
	DefaultScope        = "http"
	DefaultInFlightWait = time.Second
	DefaultMaxBodyBytes = 1 << 20
	// MaxKeyLength is the longest key accepted (Stripe's limit).
	MaxKeyLength = 255
)

// ReplayedHeader is set to "true" on responses replayed from storage.
const ReplayedHeader = "Idempotent-Replayed"

// Namespace is the identity namespace of the keys of a Middleware without
// Options.Caller (the Scope is the identity's activity type), so keys do not
// collide with activity markers in a shared table. An activity's business
// key has its Temporal namespace there: in a Temporal namespace named
// idemhttp (or idemhttp.caller, see CallerNamespace), a WithBusinessKey
// activity whose type is a Scope shares that Scope's keys, so give such a
// Middleware a table of its own.
const Namespace = "idemhttp"

// CallerNamespace is the identity namespace of the keys of a Middleware
// with Options.Caller: apart from Namespace, so no key sent to a Middleware
// without a Caller reads as a caller's.
const CallerNamespace = "idemhttp.caller"

// Options configure a Middleware. The zero value is valid.
type Options struct {
	// Dedup configures the Deduper that stores the keys' markers.
	// Dedup.ClaimWait is the in-flight wait: InFlightWait sets it, and New
	// refuses another value.
	Dedup dedupactivity.Options

	// InFlightWait bounds how long a request waits for a request with the
	// same key that is still running, before it gets 409. It sets
	// Dedup.ClaimWait. A waiting request holds a pool connection while it
	// waits: size the pool for the requests that may wait at once, or other
	// keys wait for a connection.
	//
	// Defaults to DefaultInFlightWait (1s).
	InFlightWait time.Duration

	// Scope separates key spaces: two Middlewares with different scopes on
	// one table never see each other's keys.
	//
	// Defaults to DefaultScope ("http").
	Scope string

	// Caller names the client a request comes from, as your authentication
	// found it: each caller's keys are its own, so the same key from two
	// callers is two requests, each applied once and replayed only to its
	// caller. Return what stays the same for a client (its account ID, not
	// an API key it may rotate): a request sent again under another name
	// is another request, applied again. It is called once for every
	// request with a key that gets as far as its claim (not for one refused
	// for its key's length or its body's size), and by StatusHandler, so
	// put the middleware behind your authentication. An empty name is one
	// more caller, the unnamed, whose keys every unnamed request shares.
	// Names of any length work: a key holds the name's SHA-256.
	//
	// Defaults to nil: a key is one per Scope, whoever sends it.
	Caller func(r *http.Request) string

	// KeyHeader is the request header carrying the key: a valid header
	// name (New refuses another, which no request could carry).
	//
	// Defaults to DefaultKeyHeader ("Idempotency-Key").
	KeyHeader string

	// RequireKey refuses requests without a key with 400 Bad Request.
	//
	// Defaults to false: they pass through without a transaction.
	RequireKey bool

	// MaxBodyBytes is the largest body accepted of a request with a key,
	// which the middleware reads whole before the handler runs: a larger
	// one gets 413 Request Entity Too Large, as one over the limit of an
	// http.MaxBytesHandler around the middleware does. A request without a
	// key is passed on with its body unread, so this does not bound it
	// (put an http.MaxBytesHandler around the middleware for that).
	//
	// Defaults to DefaultMaxBodyBytes (1 MiB).
	MaxBodyBytes int64

	// ReplayHeaders are the response headers stored and replayed, as they
	// were when the handler wrote its status (names match in any case). The
	// Trailer header, which declares the trailers, and a Content-Length the
	// handler set, which frames the answer, are stored whatever this names,
	// and so are the trailers.
	//
	// Defaults to Content-Type, Content-Encoding, Location and ETag.
	ReplayHeaders []string

	// Logger records the error behind each 500 response the middleware
	// gives itself (not a handler's own 500), at ERROR (at WARN when it is
	// the request's context's, ended first: the client went away); the
	// client gets only {"error":"internal error"}, not the database's
	// message.
	//
	// Defaults to slog.Default().
	Logger *slog.Logger
}

// Middleware deduplicates requests by key. Build it with New.
type Middleware struct {
	pool *pgxpool.Pool
	d    *dedupactivity.Deduper
	opts Options
	// maxBody is the largest response body that can be stored, past which
	// the recorder refuses to buffer; 0 for no bound. With the default data
	// converter, which stores the body base64-encoded, it is
	// MaxResultBytes: a larger body cannot fit. Another converter (a
	// compressing codec) may store more, so it has none.
	maxBody int
}

// New returns a Middleware storing its keys through pool. opts is checked:
// an error for one of them wraps dedupactivity.ErrInvalidOptions and names
// the field.
func New(pool *pgxpool.Pool, opts Options) (*Middleware, error) {
	if opts.InFlightWait == 0 {
		opts.InFlightWait = DefaultInFlightWait
	}
	if opts.Scope == "" {
		opts.Scope = DefaultScope
	}
	if opts.KeyHeader == "" {
		opts.KeyHeader = DefaultKeyHeader
	}
	if opts.MaxBodyBytes == 0 {
		opts.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if opts.ReplayHeaders == nil {
		opts.ReplayHeaders = []string{"Content-Type", "Content-Encoding", "Location", "ETag"}
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	switch {
	case opts.InFlightWait < time.Millisecond || opts.InFlightWait > maxInFlightWait:
		return nil, fmt.Errorf("%w: InFlightWait must be between 1ms and %v, got %v", dedupactivity.ErrInvalidOptions, maxInFlightWait, opts.InFlightWait)
	case !httpguts.ValidHeaderFieldName(opts.KeyHeader):
		// No request carries it: every one would pass on without a key.
		return nil, fmt.Errorf("%w: KeyHeader %q is not a valid header name", dedupactivity.ErrInvalidOptions, opts.KeyHeader)
	case opts.MaxBodyBytes < 0:
		return nil, fmt.Errorf("%w: MaxBodyBytes must not be negative, got %d", dedupactivity.ErrInvalidOptions, opts.MaxBodyBytes)
	case opts.Dedup.ClaimWait != 0 && opts.Dedup.ClaimWait != opts.InFlightWait:
		// It is set from InFlightWait: another value would be dropped.
		return nil, fmt.Errorf("%w: Dedup.ClaimWait cannot be set (%v): InFlightWait (%v) sets it", dedupactivity.ErrInvalidOptions, opts.Dedup.ClaimWait, opts.InFlightWait)
	case opts.Dedup.DiscardResults:
		return nil, fmt.Errorf("%w: Dedup.DiscardResults cannot be set: a replay returns the stored response", dedupactivity.ErrInvalidOptions)
	case opts.Dedup.MismatchPolicy != dedupactivity.MismatchReject:
		return nil, fmt.Errorf("%w: Dedup.MismatchPolicy must be MismatchReject: the same key with another request gets 422", dedupactivity.ErrInvalidOptions)
	case opts.Dedup.PartitionInterval > 0:
		return nil, fmt.Errorf("%w: Dedup.PartitionInterval cannot be set: request keys are business keys, which the partitioned layout does not hold", dedupactivity.ErrInvalidOptions)
	}
	opts.Dedup.ClaimWait = opts.InFlightWait
	d, err := dedupactivity.New(pool, opts.Dedup)
	if err != nil {
		return nil, err
	}
	mw := &Middleware{pool: pool, d: d, opts: opts}
	if opts.Dedup.DataConverter == nil {
		mw.maxBody = opts.Dedup.MaxResultBytes
		if mw.maxBody == 0 {
			mw.maxBody = dedupactivity.DefaultMaxResultBytes
		}
	}
	return mw, nil
}

// Deduper returns the Deduper holding the keys (for Migrate and Prune).
func (m *Middleware) Deduper() *dedupactivity.Deduper { return m.d }

// Migrate creates the marker table (see dedupactivity.Deduper.Migrate).
func (m *Middleware) Migrate(ctx context.Context) error { return m.d.Migrate(ctx) }

type txKey struct{}

// Tx returns the transaction of the request being handled: the handler
// must do its database writes through it so they commit with the key. It
// returns false for a request without a key.
//
// The Tx is closed when the handler returns: a goroutine of the handler
// that goes on gets pgx.ErrTxClosed from it (and from its Rows, Row and
// BatchResults), and one of its calls in flight then is waited for. Two
// calls at once, from two goroutines or from a callback of a Batch or a
// CopyFromSource, are refused as pgx refuses a busy connection ("conn
// busy"). What LargeObjects and Conn return is the connection's own, which
// the Tx cannot close: use it only while the handler runs.
func Tx(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(pgx.Tx)
	return tx, ok
}

// request is what a key's fingerprint covers: the same key must come with
// the same method, path and body.
type request struct {
	Method string
	Path   string
	Body   string // hex SHA-256
	// Target is the hex SHA-256 of Path when it is not UTF-8 (net/http
	// keeps a query's raw bytes), which Path's JSON turns into U+FFFD.
	// Empty otherwise, so that the fingerprint, which leaves out empty
	// members, is the one it was before Target.
	Target string
}

// response is a handler's response, as sent and, with the headers
// ReplayHeaders names, as stored (by the data converter, as JSON by
// default).
type response struct {
	Status int
	Header http.Header
	Body   []byte
	// Trailer holds the trailers sent after the body, by name (without
	// http.TrailerPrefix). Omitted when there are none, so a response
	// without trailers is stored as before trailers were kept, and one
	// stored before has none.
	Trailer http.Header `json:",omitempty"`
	// RawHeader and RawTrailer hold, as bytes, the headers and trailers
	// with a value that is not UTF-8 (HTTP allows other bytes, a Latin-1
	// filename say), which JSON, the default data converter's, would turn
	// into U+FFFD; their names are then not in Header or Trailer. Omitted
	// when there are none, so other responses are stored as before.
	RawHeader  map[string][][]byte `json:",omitempty"`
	RawTrailer map[string][][]byte `json:",omitempty"`
}

// stored is resp as it is stored: of its headers, only those names lists
// (the ReplayHeaders), the Trailer header, which declares the trailers
// stored with it, and a Content-Length the handler set, which frames the
// answer (a HEAD's says how long the body would be); values that are not
// UTF-8 as bytes. A header is kept under the key the handler set it with,
// which net/http sends as it is (an "ETag" set as a map key), and with no
// value when the handler set none (a nil Content-Type stops net/http from
// sniffing one). A header as outer has it, which a middleware around this
// one set before the handler ran and sets again on a replay, is not
// stored. resp's own maps, which the first delivery's answer is written
// from, are left as they are.
func (resp response) stored(names []string, outer http.Header) response {
	h := http.Header{}
	for _, n := range append([]string{"Trailer", "Content-Length"}, names...) {
		for k, v := range resp.Header {
			if ov, ok := outer[k]; strings.EqualFold(k, n) && !(ok && slices.Equal(ov, v)) {
				h[k] = v
			}
		}
	}
	resp.Header, resp.RawHeader = splitRaw(h)
	resp.Trailer, resp.RawTrailer = splitRaw(resp.Trailer)
	return resp
}

// replayed is a stored response as it is written again: its raw values back
// in its headers and trailers.
func (resp response) replayed() response {
	resp.Header, resp.RawHeader = joinRaw(resp.Header, resp.RawHeader), nil
	resp.Trailer, resp.RawTrailer = joinRaw(resp.Trailer, resp.RawTrailer), nil
	return resp
}

// splitRaw returns h's names whose values are all UTF-8 (in a new map, nil
// when h is), and, as bytes, the others (nil when there are none).
func splitRaw(h http.Header) (http.Header, map[string][][]byte) {
	if h == nil {
		return nil, nil
	}
	text := http.Header{}
	var raw map[string][][]byte
	for k, vs := range h {
		if !slices.ContainsFunc(vs, func(v string) bool { return !utf8.ValidString(v) }) {
			text[k] = vs
			continue
		}
		if raw == nil {
			raw = map[string][][]byte{}
		}
		for _, v := range vs {
			raw[k] = append(raw[k], []byte(v))
		}
	}
	return text, raw
}

// joinRaw undoes splitRaw: h with raw's values back in it.
func joinRaw(h http.Header, raw map[string][][]byte) http.Header {
	if len(raw) > 0 && h == nil {
		h = http.Header{}
	}
	for k, bs := range raw {
		vs := make([]string, len(bs))
		for i, b := range bs {
			vs[i] = string(b)
		}
		h[k] = vs
	}
	return h
}

// passOnError is a handler response that is not stored: one asking for a retry
// (see storable), or a refusal (3xx, 4xx) given after a statement of the
// handler failed, which aborted the transaction so that nothing can be
// stored with it. The transaction rolls back and the response is passed
// on; a retry runs the handler again.
type passOnError struct{ status int }

func (e passOnError) Error() string {
	return fmt.Sprintf("idemhttp: handler answered %d", e.status)
}

// aborted says whether a statement of the handler failed in tx, so that
// the transaction can only roll back. tx is the claim's, whose Conn has no
// side effect here: request keys are business keys, which claim before
// the handler runs (a claim that rides with the first statement would
// insert its key on Conn).
func aborted(tx pgx.Tx) bool {
	conn := tx.Conn()
	return conn == nil || conn.PgConn().TxStatus() == 'E'
}

// headerKey is the key a header value carries: without the spaces and tabs
// around it, which are not part of a field's value (RFC 9110, 5.5).
// net/http removes them over HTTP/1.1 but keeps them over HTTP/2, so one
// request sent over both would otherwise carry two keys.
func headerKey(v string) string { return strings.Trim(v, " \t") }

// requestKey is the key of a request whose key header has the values vs:
// the one value that is not blank, or "" when none is. A request that
// carries two different keys is refused (ok false): taking either could
// apply it under a key its sender did not mean, and taking none would pass
// it on unprotected.
func requestKey(vs []string) (key string, ok bool) {
	for _, v := range vs {
		switch v = headerKey(v); {
		case v == "":
		case key == "":
			key = v
		case v != key:
			return "", false
		}
	}
	return key, true
}

// identity is the event identity of key sent by caller (see Options.Caller).
func (m *Middleware) identity(caller, key string) dedupactivity.Identity {
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: Namespace, ActivityType: m.opts.Scope, Key: key}
	if m.opts.Caller != nil {
		// A fixed-width prefix, so no other caller and key read the same.
		sum := sha256.Sum256([]byte(caller))
		id.Namespace, id.Key = CallerNamespace, hex.EncodeToString(sum[:])+key
	}
	return id
}

// caller is the caller of r, or "" without Options.Caller.
func (m *Middleware) caller(r *http.Request) string {
	if m.opts.Caller == nil {
		return ""
	}
	return m.opts.Caller(r)
}

// made says whether m was made by New: not nil, and not a zero Middleware.
func (m *Middleware) made() bool { return m != nil && m.d != nil }

// errNotNew is the panic of Handler and StatusHandler on a Middleware that
// New did not make: a zero one has no key header, so it would pass every
// request on unprotected.
const errNotNew = "idemhttp: the Middleware was not made by New"

// Handler wraps next. It panics if m was not made by New, or next is nil.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	if !m.made() {
		panic(errNotNew)
	}
	if next == nil {
		panic("idemhttp: Handler needs a non-nil handler")
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, ok := requestKey(r.Header.Values(m.opts.KeyHeader))
		if !ok {
			writeError(w, http.StatusBadRequest, "more than one "+m.opts.KeyHeader+" header, with different values")
			return
		}
		if key == "" {
			if m.opts.RequireKey {
				writeError(w, http.StatusBadRequest, "missing "+m.opts.KeyHeader+" header")
				return
			}
			next.ServeHTTP(w, r)
			return
		}
		if len(key) > MaxKeyLength {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("%s longer than %d bytes", m.opts.KeyHeader, MaxKeyLength))
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.opts.MaxBodyBytes))
		var tooLarge *http.MaxBytesError
		switch {
		case errors.As(err, &tooLarge):
			// Over MaxBodyBytes, or over the smaller limit of an
			// http.MaxBytesHandler around the middleware: the same 413.
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body larger than %d bytes", tooLarge.Limit))
			return
		case isTimeout(err):
			// The server's ReadTimeout, say: the client may send again
			// (a 400 would tell it the request is refused for good).
			writeError(w, http.StatusRequestTimeout, "reading body: "+err.Error())
			return
		case err != nil:
			writeError(w, http.StatusBadRequest, "reading body: "+err.Error())
			return
		}
		sum := sha256.Sum256(body)
		in := request{Method: r.Method, Path: r.URL.RequestURI(), Body: hex.EncodeToString(sum[:])}
		if !utf8.ValidString(in.Path) {
			target := sha256.Sum256([]byte(in.Path))
			in.Target = hex.EncodeToString(target[:])
		}

		var first response // the handler's, with every header, when it ran here
		resp, outcome, err := dedupactivity.Do(r.Context(), m.d, m.identity(m.caller(r), key), in,
			func(ctx context.Context, tx pgx.Tx, _ request) (response, error) {
				// The header as net/http gives it: with what a middleware
				// around this one set, for the handler to read or add to.
				outer := w.Header().Clone()
				rec := &recorder{header: outer.Clone(), limit: m.maxBody}
				g := &txguard.Guard{}
				defer g.Close() // on a panic too
				r2 := r.WithContext(context.WithValue(ctx, txKey{}, g.Tx(tx)))
				r2.Body = io.NopCloser(bytes.NewReader(body))
				r2.ContentLength = int64(len(body))
				next.ServeHTTP(rec, r2)
				// The handler has returned, but a goroutine of it may go on
				// (see txguard): from here it is shut out of the Tx.
				g.Close()
				first = rec.response()
				if rec.over {
					return response{}, fmt.Errorf("%w: the response body is over %d bytes", dedupactivity.ErrResultTooLarge, rec.limit)
				}
				// A 2xx after a failed statement stays an error (500): the
				// handler's writes are gone, so its success cannot be told.
				if !storable(first.Status) || first.Status >= 300 && aborted(tx) {
					return response{}, passOnError{first.Status}
				}
				return first.stored(m.opts.ReplayHeaders, outer), nil
			})
		var pe passOnError
		switch {
		case err == nil && outcome == dedupactivity.OutcomeClaimed:
			writeFirst(w, first)
		case err == nil:
			w.Header().Set(ReplayedHeader, "true")
			writeResponse(w, resp.replayed())
		case errors.As(err, &pe):
			writeFirst(w, first)
		case errors.Is(err, dedupactivity.ErrPayloadMismatch):
			writeError(w, http.StatusUnprocessableEntity, "this "+m.opts.KeyHeader+" was used with a different request (method, path or body)")
		case errors.Is(err, dedupactivity.ErrClaimTimeout):
			w.Header().Set("Retry-After", "1")
			writeError(w, http.StatusConflict, "a request with this "+m.opts.KeyHeader+" is still being processed; retry later")
		default:
			m.internalError(w, r, fmt.Errorf("idemhttp: idempotency store: %w", err))
		}
	})
}

// Applied says whether a request with key was applied: its handler
// committed and answered with a stored 2xx status (a status below 500 other
// than 408, 409, 425 and 429 is stored), which is what outbox.HTTPSender
// takes for success. For a key whose stored answer
// is a 3xx or 4xx, the request was refused for good (a resend gets the
// same answer replayed): Applied returns false and a *RejectedError, which
// matches outbox.ErrRejected. Keys are known until Deduper().Prune removes
// their markers, after their retention. The stored response is decoded to read
// its status, so Applied fails (the reconciler reports the message as
// unknown) if the data converter can no longer decode it. With Options.Caller, use AppliedFor: Applied then
// fails with dedupactivity.ErrInvalidOptions.
func (m *Middleware) Applied(ctx context.Context, key string) (bool, error) {
	if m.opts.Caller != nil {
		return false, fmt.Errorf("%w: Options.Caller is set, so keys are per caller: use AppliedFor", dedupactivity.ErrInvalidOptions)
	}
	return m.AppliedFor(ctx, "", key)
}

// AppliedFor is Applied for the key sent by caller, for a Middleware with
// Options.Caller (without it, caller is ignored: keys are shared). Spaces
// and tabs around key are not part of it, as in the header.
func (m *Middleware) AppliedFor(ctx context.Context, caller, key string) (bool, error) {
	if key = headerKey(key); key == "" {
		return false, fmt.Errorf("idemhttp: %w", dedupactivity.ErrEmptyBusinessKey)
	}
	var r response
	ok, err := m.d.Result(ctx, m.identity(caller, key), &r)
	if err != nil {
		return false, fmt.Errorf("idemhttp: %w", err)
	}
	if ok && r.Status >= 300 {
		return false, &RejectedError{Caller: caller, Key: key, Status: r.Status}
	}
	return ok, nil
}

// RejectedError is Applied's answer for a key whose request was refused
// for good: its stored answer has a 3xx or 4xx status. It matches
// outbox.ErrRejected.
type RejectedError struct {
	Caller string // with Options.Caller, the key's caller
	Key    string // the key, as the request sent it
	Status int    // the stored answer's status
}

// Error says which key (and caller) was refused, and with what status.
func (e *RejectedError) Error() string {
	if e.Caller != "" {
		return fmt.Sprintf("idemhttp: the request of caller %q with key %q was answered %d, not applied", e.Caller, e.Key, e.Status)
	}
	return fmt.Sprintf("idemhttp: the request with key %q was answered %d, not applied", e.Key, e.Status)
}

// Is makes RejectedError match outbox.ErrRejected.
func (e *RejectedError) Is(target error) bool { return target == outbox.ErrRejected }

// StatusHandler answers "did you apply key K?": GET with the key as the
// path value "key" (a route such as "GET /idempotency-keys/{key}") or the
// query parameter "key". It answers 200 {"applied":true} when applied, 404
// {"applied":false} when not, 409 {"applied":false,"status":N} when the
// request was refused for good with the 3xx or 4xx status N, 400 for no
// key or one longer than MaxKeyLength, and 500 when it cannot tell. With
// Options.Caller it answers about the asking caller's key.
// outbox.HTTPChecker reads it. It panics if m was not made by New.
func (m *Middleware) StatusHandler() http.Handler {
	if !m.made() {
		panic(errNotNew)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.PathValue("key")
		if key == "" {
			key = r.URL.Query().Get("key")
		}
		if headerKey(key) == "" { // blanks alone are no key, as in the header
			writeError(w, http.StatusBadRequest, "no key")
			return
		}
		if len(headerKey(key)) > MaxKeyLength { // refused by Handler too: never applied
			writeError(w, http.StatusBadRequest, fmt.Sprintf("key longer than %d bytes", MaxKeyLength))
			return
		}
		applied, err := m.AppliedFor(r.Context(), m.caller(r), key)
		var rejected *RejectedError
		switch {
		case errors.As(err, &rejected):
			writeJSON(w, http.StatusConflict, map[string]any{"applied": false, "status": rejected.Status})
		case err != nil:
			m.internalError(w, r, err)
		case applied:
			writeJSON(w, http.StatusOK, map[string]any{"applied": true})
		default:
			writeJSON(w, http.StatusNotFound, map[string]any{"applied": false})
		}
	})
}

// internalError answers 500 and logs err, which the client does not see.
// A request that failed because its context ended first (the client went
// away, the server shuts down) is a warning: nothing is wrong with the
// service. Any other failure is an error, whether or not the client left.
func (m *Middleware) internalError(w http.ResponseWriter, r *http.Request, err error) {
	if ctxErr := r.Context().Err(); ctxErr != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		m.opts.Logger.WarnContext(r.Context(), "idemhttp: the request ended before its answer", "method", r.Method, "path", r.URL.Path, "cause", ctxErr, "error", err)
	} else {
		m.opts.Logger.ErrorContext(r.Context(), "idemhttp: answered 500", "method", r.Method, "path", r.URL.Path, "error", err)
	}
	writeError(w, http.StatusInternalServerError, "internal error")
}

func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, map[string]string{"error": msg})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// recorder buffers the handler's response as net/http would send it: the
// status, the header as it was when the status was written, the body, and
// the trailers.
type recorder struct {
	header http.Header // the handler's, which it may change at any time
	sent   http.Header // header as of the final status, trailers left out
	status int
	body   bytes.Buffer
	limit  int  // the largest body buffered; 0 for no bound
	over   bool // a Write was refused for going over limit
}

// errBodyTooLarge is a Write's error past the body that can be stored; a
// handler can tell it with errors.Is(err, dedupactivity.ErrResultTooLarge).
var errBodyTooLarge = fmt.Errorf("idemhttp: response body too large to store for replay: %w", dedupactivity.ErrResultTooLarge)

func (r *recorder) Header() http.Header { return r.header }

// WriteHeader keeps the first final status and the header as it is then,
// which is what net/http sends: a header set later is not sent, only the
// trailers are, after the body. An informational status (1xx, such as 103
// Early Hints) is not the answer: it is dropped, not stored or sent. A
// status that is not three digits panics, as net/http's WriteHeader does:
// kept, it would commit the handler's writes and then panic as it is sent,
// on every replay too.
func (r *recorder) WriteHeader(status int) {
	if r.status != 0 {
		return
	}
	if status < 100 || status > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", status))
	}
	if status < 200 {
		return
	}
	r.status = status
	r.sent = r.header.Clone()
	for k := range r.sent {
		if strings.HasPrefix(k, http.TrailerPrefix) {
			delete(r.sent, k) // a trailer, which net/http leaves out of the header
		}
	}
}

// Write buffers b, writing status 200 first if no status was written. It
// refuses b with errBodyTooLarge if the body would go over limit under a
// status that is stored (one that is not is passed on, never stored). As
// net/http does, it refuses a body after a status that has none (204, 304)
// with http.ErrBodyNotAllowed; a HEAD answer's body is kept, and dropped
// as it is sent, so the first response and a replay get the same
// Content-Length from net/http.
func (r *recorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.WriteHeader(http.StatusOK)
	}
	if len(b) == 0 {
		return 0, nil
	}
	if r.status == http.StatusNoContent || r.status == http.StatusNotModified {
		return 0, http.ErrBodyNotAllowed
	}
	if r.limit > 0 && r.body.Len()+len(b) > r.limit && storable(r.status) {
		// A status that is not stored is passed on as it is, body and all.
		r.over = true
		return 0, errBodyTooLarge
	}
	return r.body.Write(b)
}

// response is the handler's response once it returned (status 200 if it
// wrote none, as net/http sends).
func (r *recorder) response() response {
	if r.status == 0 {
		r.WriteHeader(http.StatusOK)
	}
	return response{Status: r.status, Header: r.sent, Body: r.body.Bytes(), Trailer: r.trailers()}
}

// trailers are what net/http sends after the body: the header's keys with
// http.TrailerPrefix, set at any time, and the names the Trailer header
// declared as of the status (those a trailer may carry), with the values
// they have when the handler returned. Nil when there are none.
func (r *recorder) trailers() http.Header {
	t := http.Header{}
	for k, v := range r.header {
		if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
			t[name] = slices.Clone(v)
		}
	}
	for _, declared := range r.sent["Trailer"] {
		for name := range strings.SplitSeq(declared, ",") {
			name = http.CanonicalHeaderKey(strings.TrimSpace(name))
			if name == "" || !httpguts.ValidTrailerHeader(name) {
				continue // as net/http skips it
			}
			for _, v := range r.header[name] {
				t.Add(name, v)
			}
		}
	}
	if len(t) == 0 {
		return nil
	}
	return t
}

// isTimeout reports whether err is a read that ran out of time (a
// deadline on the connection: os.ErrDeadlineExceeded is such a net.Error).
func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// writeFirst sends the response of the handler that ran here, whose
// header started as w's (see Handler): a header the handler deleted from
// it is deleted from w's too, as net/http would not send it.
func writeFirst(w http.ResponseWriter, resp response) {
	h := w.Header()
	for k := range h {
		if _, ok := resp.Header[k]; !ok {
			delete(h, k)
		}
	}
	writeResponse(w, resp)
}

// writeResponse sends resp as its handler would have: the headers, the
// status, the body, then the trailers. The trailers are set, with
// http.TrailerPrefix, before the status: net/http then leaves them out of
// the header and sends them after the body, in a chunked body over
// HTTP/1.1, whether or not the Trailer header declared them. (Set only
// after a short body, an undeclared one would be dropped: the body is no
// longer chunked once its length is known.)
func writeResponse(w http.ResponseWriter, resp response) {
	h := w.Header()
	for k, v := range resp.Header {
		h[k] = v
	}
	for k, v := range resp.Trailer {
		h[http.TrailerPrefix+k] = v
	}
	w.WriteHeader(resp.Status)
	// The header is sent as it is now. A trailer's name that is also a
	// header (a declared one set before the status, say) is removed from
	// it, so that net/http, which reads the trailers from it after the
	// body, sends the trailer's values alone.
	for k := range resp.Trailer {
		delete(h, k)
	}
	_, _ = w.Write(resp.Body)
}

// storable says whether a response is kept for replay, with the handler's
// writes: a 5xx is not (the request may succeed on a retry), nor are the 4xx
// answers that ask the client to retry (408, 409, 425, 429), which the
// outbox's HTTPSender retries too. Everything else is final, as Stripe
// keeps it.
func storable(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status < 500
}
