package outbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"net/textproto"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"golang.org/x/net/http/httpguts"
)

// Delivery is one attempt to deliver a message, as a Sender sees it.
type Delivery struct {
	// ID is the message's row ID in the outbox table.
	ID int64
	// Key is the message's idempotency key: the same on every attempt.
	Key string
	// Destination, Name and Headers are the message's, as Enqueue stored
	// them (see Message).
	Destination string
	Name        string
	Headers     map[string]string
	// Payload is the message's JSON encoding.
	Payload []byte
	// Attempt counts this message's sends, this one included (from 1). A
	// send cut off by the relay stopping is given back and not counted, so
	// the next send has the same Attempt; a lease a relay held when its
	// process stopped, before it reached this message, is counted. Attempt
	// is also the lease's fencing token (docs/outbox.md, "Relay").
	Attempt int

	tries      int   // sends since enqueued or re-queued, this one included
	stalls     int   // sends that began and never recorded an outcome (see Relay.begin)
	unreadable error // the stored message cannot be sent as it is (see claim)
}

// Sender delivers messages. Send returns nil only when the destination has
// accepted the message; an error wrapping ErrPermanent makes the message
// dead at once, any other error is retried with backoff, waiting at least
// what the error asks for (RetryAfter; a StatusError's RetryAfter). Send
// must pass d.Key to the destination so that a re-send (after a crash
// between send and acknowledgement, or a lost response) is applied once
// there. Send must return once ctx is done: the relay ends ctx at the end
// of the message's lease, after which another relay may send the message.
type Sender interface {
	Send(ctx context.Context, d Delivery) error
}

// SenderFunc adapts a function to Sender.
type SenderFunc func(ctx context.Context, d Delivery) error

// Send calls f.
func (f SenderFunc) Send(ctx context.Context, d Delivery) error { return f(ctx, d) }

// RetryAfter returns err asking the relay to wait at least after before the
// message's next send, as a destination's Retry-After or a rate limit says:
// the wait is the longer of after and the relay's backoff, capped at
// RelayConfig.MaxBackoff. A non-positive after asks for nothing. err is
// retried as it would be without it: an err wrapping ErrPermanent still
// makes the message dead, and so does a message's last attempt. after is
// also the destination's wait (not lengthened by the backoff, capped at
// MaxBackoff): the relay sends it nothing meanwhile (see
// RelayConfig.MinBackoff). Returned by a Checker, it asks the Reconciler to
// ask the destination nothing for after, up to ReconcilerConfig.MaxWait.
// RetryAfter returns nil if err is nil.
func RetryAfter(err error, after time.Duration) error {
	if err == nil {
		return nil
	}
	return &retryAfterError{err: err, after: after}
}

// retryAfterError is RetryAfter's error.
type retryAfterError struct {
	err   error
	after time.Duration
}

func (e *retryAfterError) Error() string { return e.err.Error() }

func (e *retryAfterError) Unwrap() error             { return e.err }
func (e *retryAfterError) retryAfter() time.Duration { return e.after }

// waitAsked is the wait the first error in err's tree that asks for one
// (RetryAfter, StatusError.RetryAfter) asks for; 0 if none does.
func waitAsked(err error) time.Duration {
	var w interface{ retryAfter() time.Duration }
	if errors.As(err, &w) {
		return w.retryAfter()
	}
	return 0
}

// destinationWait is the wait err asks of its whole destination: a
// RetryAfter's, or a StatusError's on a 429 or a 503, whose Retry-After
// speaks for the service (RFC 9110, section 10.2.3; RFC 6585); 0 if none.
// A Retry-After on another status (idemhttp's 409 for a key still in
// progress) asks a wait of that message alone.
func destinationWait(err error) time.Duration {
	var w interface{ retryAfter() time.Duration }
	if !errors.As(err, &w) {
		return 0
	}
	if se, ok := w.(*StatusError); ok && !serviceWide(se.StatusCode) {
		return 0
	}
	return w.retryAfter()
}

// serviceWide says whether a Retry-After on status speaks for the whole
// service: 429 Too Many Requests and 503 Service Unavailable.
func serviceWide(status int) bool {
	return status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable
}

// waits holds, per destination, the end of the wait its answers asked for
// (RetryAfter; the latest end, while it is not over): a Relay sends it
// nothing, a Reconciler asks it nothing, until then. Its zero value holds
// none; it is safe for concurrent use.
type waits struct {
	mu sync.Mutex
	m  map[string]time.Time
}

// active returns the destinations whose wait is not over at now, with the
// end of each; nil if none. Waits that are over are forgotten.
func (w *waits) active(now time.Time) map[string]time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out map[string]time.Time
	for dest, until := range w.m {
		if !now.Before(until) {
			delete(w.m, dest)
			continue
		}
		if out == nil {
			out = map[string]time.Time{}
		}
		out[dest] = until
	}
	return out
}

// until returns the end of destination's wait if it is not over at now.
func (w *waits) until(destination string, now time.Time) (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	until, ok := w.m[destination]
	return until, ok && now.Before(until)
}

// set records that destination asked for nothing until until. A wait
// already recorded that ends later stays: answers to sends made at once
// (concurrent passes of one Relay) come back in any order, and a shorter
// one is no sign that the longer is over. It returns the end kept.
func (w *waits) set(destination string, until time.Time) time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.m == nil {
		w.m = map[string]time.Time{}
	}
	if cur, ok := w.m[destination]; ok && cur.After(until) {
		return cur
	}
	w.m[destination] = until
	return until
}

// destinations returns the keys of m, never nil: a query's
// "destination <> ALL($n)" with a NULL array would match no row.
func destinations(m map[string]time.Time) []string {
	out := make([]string, 0, len(m))
	for dest := range m {
		out = append(out, dest)
	}
	return out
}

// retryAfterHeader reads a Retry-After value (RFC 9110, section 10.2.3):
// delay-seconds or an HTTP-date, which now turns into a wait. 0 for a value
// it cannot read, or a date past.
func retryAfterHeader(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	const most = uint64(math.MaxInt64 / int64(time.Second))
	switch n, err := strconv.ParseUint(v, 10, 64); {
	case err == nil:
		return time.Duration(min(n, most)) * time.Second
	case errors.Is(err, strconv.ErrRange):
		return time.Duration(most) * time.Second // digits past uint64: the longest wait there is
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t.Sub(now)
	}
	return 0
}

// IdempotencyKeyHeader is the HTTP header carrying the idempotency key.
const IdempotencyKeyHeader = "Idempotency-Key"

// DefaultHTTPTimeout bounds one HTTP delivery.
const DefaultHTTPTimeout = 10 * time.Second

// HTTPSenderConfig configures an HTTPSender.
type HTTPSenderConfig struct {
	// Endpoints maps each destination name to the URL its messages are
	// POSTed to. Required (at least one).
	Endpoints map[string]string

	// Client sends the requests. Its own Timeout, if any, applies too. Its
	// CheckRedirect does not: the sender uses a copy that follows no
	// redirect (see HTTPSender).
	//
	// Defaults to a client with no timeout of its own (Timeout bounds each
	// request).
	Client *http.Client

	// Timeout bounds each request, response body included. Keep it below
	// the relay's Lease.
	//
	// Defaults to DefaultHTTPTimeout (10s).
	Timeout time.Duration
}

// HTTPSender POSTs each message's JSON payload to its destination's URL,
// with the Idempotency-Key header, Content-Type application/json and the
// message's headers. A 2xx response is success; 408, 409, 425, 429 and 5xx
// responses and network errors are retried (StatusError, or the transport's
// error), not before the response's Retry-After (up to the relay's
// MaxBackoff); other 4xx and every 3xx response are permanent (a
// StatusError wrapping ErrPermanent). Redirects are not followed: following one would
// POST the message elsewhere (307, 308) or GET another page (301 to 303)
// and take that answer's 2xx for a delivery.
type HTTPSender struct {
	cfg HTTPSenderConfig
}

// NewHTTPSender checks cfg and returns an HTTPSender.
func NewHTTPSender(cfg HTTPSenderConfig) (*HTTPSender, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, fmt.Errorf("%w: HTTPSenderConfig.Endpoints is empty", ErrInvalidConfig)
	}
	for dest, u := range cfg.Endpoints {
		pu, err := url.Parse(u)
		if err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
			return nil, fmt.Errorf("%w: HTTPSenderConfig.Endpoints[%q] = %q is not an http(s) URL", ErrInvalidConfig, dest, u)
		}
	}
	// A copy: the caller's map, changed later, would skip the check above
	// and race with the relays' sends.
	cfg.Endpoints = maps.Clone(cfg.Endpoints)
	client := http.Client{}
	if cfg.Client != nil {
		client = *cfg.Client
	}
	client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	cfg.Client = &client
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultHTTPTimeout
	}
	if cfg.Timeout < 0 {
		return nil, fmt.Errorf("%w: HTTPSenderConfig.Timeout must be positive, got %s", ErrInvalidConfig, cfg.Timeout)
	}
	return &HTTPSender{cfg: cfg}, nil
}

// StatusError is a non-2xx HTTP response. It matches ErrPermanent with
// errors.Is when the status is not worth retrying.
type StatusError struct {
	// StatusCode is the response's status.
	StatusCode int
	// Body is the start of the response body (at most 512 bytes), and, if
	// reading it failed, why.
	Body string
	// RetryAfter is the wait the response's Retry-After header asks for
	// (delay-seconds or an HTTP-date), 0 without one or with one that
	// cannot be read. The relay waits at least this long before the next
	// send of a retryable status, up to RelayConfig.MaxBackoff; on a 429
	// or a 503 it sends the destination nothing meanwhile.
	RetryAfter time.Duration
}

func (e *StatusError) retryAfter() time.Duration { return e.RetryAfter }

// Error gives the status, its text and the start of the body.
func (e *StatusError) Error() string {
	return fmt.Sprintf("outbox: destination answered %d %s: %s", e.StatusCode, http.StatusText(e.StatusCode), e.Body)
}

// Is makes a permanent status match ErrPermanent.
func (e *StatusError) Is(target error) bool {
	return target == ErrPermanent && !Retryable(e.StatusCode)
}

// Retryable says whether a delivery answered with status is worth
// retrying: 408 Request Timeout, 409 Conflict (the destination is still
// processing the same key), 425 Too Early, 429 Too Many Requests and every
// 5xx.
func Retryable(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return true
	}
	return status >= 500
}

// checkHeaders refuses header names and values net/http would refuse to
// send, so such a message fails when enqueued, not at every send; values
// that are not valid UTF-8, which the headers' jsonb column would store
// changed (U+FFFD for each bad byte); and two names that differ only in
// case, one header for HTTP, whose value would be either at each send.
func checkHeaders(h map[string]string) error {
	var seen map[string]bool
	for k, v := range h {
		switch {
		case !httpguts.ValidHeaderFieldName(k):
			return fmt.Errorf("invalid header name %q", k)
		case !httpguts.ValidHeaderFieldValue(v) || !utf8.ValidString(v):
			return fmt.Errorf("invalid value of header %q (HTTP allows no control character; stored, it must be valid UTF-8)", k)
		}
		if len(h) > 1 {
			if seen == nil {
				seen = make(map[string]bool, len(h))
			}
			c := textproto.CanonicalMIMEHeaderKey(k)
			if seen[c] {
				return fmt.Errorf("header %q given twice, in names that differ only in case", c)
			}
			seen[c] = true
		}
	}
	return nil
}

// maxKeyLength bounds an explicit Message.Key: Stripe's limit, and
// idemhttp's MaxKeyLength.
const maxKeyLength = 255

// checkKey refuses an idempotency key that the Idempotency-Key header
// cannot carry as it is: HTTP trims leading and trailing spaces, and
// net/http refuses control characters.
func checkKey(k string) error {
	switch {
	case len(k) > maxKeyLength:
		return fmt.Errorf("the key is %d bytes, longer than %d", len(k), maxKeyLength)
	case !utf8.ValidString(k) || !httpguts.ValidHeaderFieldValue(k):
		return fmt.Errorf("the key %q is not valid UTF-8 without control characters", k)
	case strings.TrimSpace(k) != k:
		return fmt.Errorf("the key %q has leading or trailing space, which HTTP trims", k)
	}
	return nil
}

// storable says whether s can be stored in a text column: valid UTF-8
// without NUL.
func storable(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

// maxDrainedBody bounds what drainClose reads of a response body.
const maxDrainedBody = 64 << 10

// drainClose reads what is left of a response body (up to maxDrainedBody)
// and closes it: read to its end, it lets net/http reuse the connection;
// closed unread, every request would dial (and shake hands over TLS) anew.
// Past maxDrainedBody, closing is cheaper.
func drainClose(body io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(body, maxDrainedBody))
	body.Close()
}

// Send POSTs d to its destination.
func (s *HTTPSender) Send(ctx context.Context, d Delivery) error {
	u, ok := s.cfg.Endpoints[d.Destination]
	if !ok {
		return fmt.Errorf("%w: %w %q", ErrPermanent, ErrUnknownDestination, d.Destination)
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(d.Payload))
	if err != nil {
		return fmt.Errorf("%w: build request: %w", ErrPermanent, err)
	}
	if err := checkKey(d.Key); err != nil {
		return fmt.Errorf("%w: %w", ErrPermanent, err) // written by something other than Enqueue
	}
	if err := checkHeaders(d.Headers); err != nil {
		return fmt.Errorf("%w: %w", ErrPermanent, err) // written by something other than Enqueue
	}
	for k, v := range d.Headers {
		req.Header.Set(k, v)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(IdempotencyKeyHeader, d.Key)
	resp, err := s.cfg.Client.Do(req)
	if err != nil {
		return fmt.Errorf("outbox: send to %s: %w", d.Destination, err)
	}
	defer drainClose(resp.Body)
	body, err := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return nil // accepted; a failure to read the rest of the body does not matter
	}
	if err != nil && !errors.Is(err, io.EOF) {
		body = append(body, []byte(" (reading body: "+err.Error()+")")...)
	}
	return &StatusError{StatusCode: resp.StatusCode, Body: string(body), RetryAfter: retryAfterHeader(resp.Header.Get("Retry-After"), time.Now())}
}
