package outbox

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.temporal.io/sdk/activity"

	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/heartbeat"
)

// Checker asks a destination whether it applied a message: "did you apply
// key K?". It returns true or false when the destination knows; an error
// wrapping ErrRejected when it knows the key and refused the message for
// good (the message becomes StateRejected); and any other error when the
// answer is unknown (the destination is down, say): the message is then
// reported, not changed. An unknown answer may ask for a wait (RetryAfter;
// a StatusError's RetryAfter on a 429 or a 503), as a rate-limited status
// endpoint does: the Reconciler then asks that destination nothing more
// until the wait is over (see ReconcilerConfig.MaxWait). A panic in Applied
// is an unknown answer.
type Checker interface {
	Applied(ctx context.Context, d Delivery) (bool, error)
}

// CheckerFunc adapts a function to Checker.
type CheckerFunc func(ctx context.Context, d Delivery) (bool, error)

// Applied calls f.
func (f CheckerFunc) Applied(ctx context.Context, d Delivery) (bool, error) { return f(ctx, d) }

// HTTPChecker asks over HTTP: a GET of URL(destination, key) answered 200
// with the JSON body {"applied":true} means applied, 404 with
// {"applied":false} means not applied, 409 with
// {"applied":false,"status":N} (N a 3xx or 4xx status) means refused for
// good with status N (ErrRejected), anything else is unknown: a status
// without its body (a wrong URL's catch-all page or 404, say) says nothing
// of the key. A 429 or a
// 503 with a Retry-After header asks for that wait. No redirect is
// followed: a 3xx is unknown, as a redirect's 200 (a login page, say)
// would say nothing of the key. The idemhttp package's
// Middleware.StatusHandler answers this way.
type HTTPChecker struct {
	// URL returns the status URL of key at destination; "" means the
	// destination cannot be asked (unknown). Required.
	URL func(destination, key string) string
	// Client sends the requests. Its own Timeout, if any, applies too. Its
	// CheckRedirect does not: a copy that follows no redirect is used.
	// Defaults to a client with no timeout of its own (Timeout bounds each
	// check).
	Client *http.Client
	// Timeout bounds each check, response included, whatever Client: a
	// status endpoint that never answers is then reported (unknown) and
	// asked last in later runs, instead of holding the run.
	// RegisterReconciler takes a Timeout of at most 28 minutes (see
	// there); Reconcile takes any.
	//
	// Defaults to DefaultHTTPTimeout (10s).
	Timeout time.Duration
}

// Applied asks the destination.
func (c HTTPChecker) Applied(ctx context.Context, d Delivery) (bool, error) {
	if c.URL == nil {
		return false, fmt.Errorf("%w: HTTPChecker.URL is nil", ErrInvalidConfig)
	}
	u := c.URL(d.Destination, d.Key)
	if u == "" {
		return false, fmt.Errorf("outbox: no status URL for destination %q", d.Destination)
	}
	client := http.Client{}
	if c.Client != nil {
		client = *c.Client
	}
	client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = DefaultHTTPTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return false, fmt.Errorf("outbox: check %s: %w", d.Key, err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return false, fmt.Errorf("outbox: check %s: %w", d.Key, err)
	}
	defer drainClose(resp.Body)
	// Every answer is read from its body as well as its status: a 200 or a
	// 404 alone is also what a status URL that is wrong gets (a catch-all
	// page, another service's 404), and taking that for "applied" would
	// settle a message never applied.
	var answer struct {
		Applied *bool `json:"applied"`
		Status  int   `json:"status"`
	}
	said := func(applied bool) bool { return answer.Applied != nil && *answer.Applied == applied }
	if json.NewDecoder(io.LimitReader(resp.Body, 4096)).Decode(&answer) != nil {
		answer.Applied = nil
	}
	switch {
	case resp.StatusCode == http.StatusOK && said(true):
		return true, nil
	case resp.StatusCode == http.StatusNotFound && said(false):
		return false, nil
	case resp.StatusCode == http.StatusConflict && said(false) && answer.Status >= 300 && answer.Status < 500:
		// Only with a refusal's status in the body: a bare 409 is also how
		// a server says "still in progress".
		return false, fmt.Errorf("%w: check %s: the destination answered it %d", ErrRejected, d.Key, answer.Status)
	}
	err = fmt.Errorf("outbox: check %s: status %d", d.Key, resp.StatusCode)
	if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusNotFound {
		err = fmt.Errorf("%w, without the body {\"applied\":%t}", err, resp.StatusCode == http.StatusOK)
	}
	if wait := retryAfterHeader(resp.Header.Get("Retry-After"), time.Now()); wait > 0 && serviceWide(resp.StatusCode) {
		return false, RetryAfter(fmt.Errorf("%w (Retry-After: %s)", err, wait), wait)
	}
	return false, err
}

// StatusURL returns base + "/" + the path-escaped key: an HTTPChecker.URL
// for destinations whose status endpoints share the layout base/{key}.
func StatusURL(bases map[string]string) func(destination, key string) string {
	return func(destination, key string) string {
		b, ok := bases[destination]
		if !ok {
			return ""
		}
		return b + "/" + url.PathEscape(key)
	}
}

// Defaults of ReconcilerConfig.
const (
	DefaultUnackedAfter = 5 * time.Minute
	DefaultMaxRequeues  = 3
	DefaultReconcileMax = 1000
	DefaultMaxWait      = time.Hour
	// DefaultKeyRetention is Stripe's 24 hours, the least a destination
	// known to us keeps keys, less an hour for the relay's Lease and the
	// difference between the clocks.
	DefaultKeyRetention = 23 * time.Hour
)

// ReconcilerConfig configures a Reconciler.
type ReconcilerConfig struct {
	// Checker asks destinations whether they applied a message. Required.
	Checker Checker

	// UnackedAfter is how long a message may go without an acknowledgement,
	// from the first send a relay began (or from the reconciler's last
	// question, for one it re-queued), before the reconciler asks its
	// destination about it (a message whose sends time out or whose
	// responses are lost, say).
	//
	// Defaults to DefaultUnackedAfter (5m).
	UnackedAfter time.Duration

	// MaxRequeues is how many times a dead message the destination has not
	// applied is re-queued (each time with a fresh MaxAttempts budget).
	// Past it, the message stays dead and is reported. Set -1 for none:
	// every dead letter the destination has not applied is reported.
	//
	// Defaults to DefaultMaxRequeues (3).
	MaxRequeues int

	// KeyRetention is how long the destinations keep a message's
	// idempotency key, and answer about it, after they receive it. A
	// message first sent longer ago than this, and not acknowledged since,
	// is not re-queued when its destination says it did not apply it: the
	// destination may have applied it and forgotten the key, and a re-send
	// would apply it again. It is reported instead, for a person to settle.
	// Set it, and RelayConfig.KeyRetention, no longer than the shortest
	// retention of the destinations, less the clock difference between
	// this database and theirs and the relay's Lease (a send begun just
	// inside KeyRetention reaches the destination up to a Lease later), and
	// the longest a destination takes over a request (a message re-queued
	// counts from the question, but a send the destination was still
	// finishing then reached it earlier, and its key is kept from then): a
	// destination behind idemhttp keeps keys for its Deduper's Retention
	// (30 days by default); Stripe may remove a key once it is 24 hours
	// old.
	//
	// Defaults to DefaultKeyRetention (23h).
	KeyRetention time.Duration

	// MaxMessages bounds the messages one Reconcile call looks at.
	//
	// Defaults to DefaultReconcileMax (1000).
	MaxMessages int

	// MaxWait bounds the wait a destination's answer can ask for (see
	// Checker): the Reconciler asks that destination about none of its
	// messages for the rest of the run that was asked, and in later runs
	// until the wait is over, and lists it in ReconcileReport.Waiting. The
	// wait is the Reconciler's own (each worker's), not kept in the
	// database.
	//
	// Defaults to DefaultMaxWait (1h).
	MaxWait time.Duration

	// Destinations are the destinations whose MetricReconciled series, one
	// per action, are made at zero when the Reconciler is made. PromQL's
	// increase() and rate() see no increase in a counter series that first
	// appears at 1, so without it the first rejection of a destination
	// shows in neither (nor in an alert on them). A destination not listed
	// has its series made when a Reconcile first settles or reports one of
	// its messages, whose own action does not show.
	//
	// Defaults to none.
	Destinations []string

	// TracerProvider and MeterProvider default to the OTel globals.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
}

// Reconciler settles what a relay cannot settle alone: messages sent but not
// acknowledged for longer than UnackedAfter, and dead messages. For each it
// asks the destination (Checker) and marks the message applied, re-queues
// it, marks it rejected (the destination refused it for good), or reports
// it.
type Reconciler struct {
	ob         *Outbox
	cfg        ReconcilerConfig
	checkTime  time.Duration // the longest a check takes, when the Checker bounds it (HTTPChecker)
	tracer     trace.Tracer
	reconciled metric.Int64Counter
	zero       *zeroSeries
	waits      waits
	beatEvery  time.Duration // when set (tests only), replaces sweepHeartbeatEvery
}

// NewReconciler returns a Reconciler for ob. cfg is checked; an error names
// the field at fault and wraps ErrInvalidConfig.
func NewReconciler(ob *Outbox, cfg ReconcilerConfig) (*Reconciler, error) {
	if ob == nil {
		return nil, fmt.Errorf("%w: Outbox is nil", ErrInvalidConfig)
	}
	if cfg.UnackedAfter == 0 {
		cfg.UnackedAfter = DefaultUnackedAfter
	}
	if cfg.MaxRequeues == 0 {
		cfg.MaxRequeues = DefaultMaxRequeues
	}
	if cfg.MaxMessages == 0 {
		cfg.MaxMessages = DefaultReconcileMax
	}
	if cfg.MaxWait == 0 {
		cfg.MaxWait = DefaultMaxWait
	}
	if cfg.KeyRetention == 0 {
		cfg.KeyRetention = DefaultKeyRetention
	}
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = otel.GetTracerProvider()
	}
	if cfg.MeterProvider == nil {
		cfg.MeterProvider = otel.GetMeterProvider()
	}
	var noURL bool // an HTTPChecker that cannot ask
	var timeout, checkTime time.Duration
	switch c := cfg.Checker.(type) {
	case HTTPChecker:
		noURL, timeout = c.URL == nil, c.Timeout
		checkTime = cmp.Or(timeout, DefaultHTTPTimeout)
	case *HTTPChecker:
		noURL = c == nil || c.URL == nil
		if c != nil {
			timeout = c.Timeout
		}
		checkTime = cmp.Or(timeout, DefaultHTTPTimeout)
	}
	fn, isFunc := cfg.Checker.(CheckerFunc)
	switch {
	case cfg.Checker == nil, isFunc && fn == nil:
		return nil, fmt.Errorf("%w: ReconcilerConfig.Checker is nil", ErrInvalidConfig)
	case noURL:
		return nil, fmt.Errorf("%w: ReconcilerConfig.Checker is an HTTPChecker without a URL", ErrInvalidConfig)
	case timeout < 0:
		return nil, fmt.Errorf("%w: HTTPChecker.Timeout must be 0 (the default) or more, got %s", ErrInvalidConfig, timeout)
	case cfg.UnackedAfter < time.Millisecond:
		return nil, fmt.Errorf("%w: ReconcilerConfig.UnackedAfter must be at least 1ms, got %s", ErrInvalidConfig, cfg.UnackedAfter)
	case cfg.MaxRequeues < -1:
		return nil, fmt.Errorf("%w: ReconcilerConfig.MaxRequeues must be -1 (none), 0 (the default) or more, got %d", ErrInvalidConfig, cfg.MaxRequeues)
	case cfg.MaxMessages < 1:
		return nil, fmt.Errorf("%w: ReconcilerConfig.MaxMessages must be at least 1, got %d", ErrInvalidConfig, cfg.MaxMessages)
	case cfg.KeyRetention < time.Second:
		return nil, fmt.Errorf("%w: ReconcilerConfig.KeyRetention must be 0 (the default) or at least 1s, got %s", ErrInvalidConfig, cfg.KeyRetention)
	case cfg.MaxWait < 0:
		return nil, fmt.Errorf("%w: ReconcilerConfig.MaxWait must be 0 (the default) or more, got %s", ErrInvalidConfig, cfg.MaxWait)
	}
	if cfg.MaxRequeues == -1 {
		cfg.MaxRequeues = 0
	}
	rc := &Reconciler{ob: ob, cfg: cfg, checkTime: checkTime, tracer: cfg.TracerProvider.Tracer(ScopeName)}
	var err error
	if rc.reconciled, err = cfg.MeterProvider.Meter(ScopeName).Int64Counter(MetricReconciled,
		metric.WithDescription("Outbox messages the reconciler settled or reported."), metric.WithUnit("{message}")); err != nil {
		return nil, fmt.Errorf("outbox: create %s: %w", MetricReconciled, err)
	}
	rc.zero = newZeroSeries(rc.reconciled, ReconcileActionKey, actionApplied, actionRequeued, actionRejected, actionUnresolved)
	for _, d := range cfg.Destinations {
		rc.zero.destination(d)
	}
	return rc, nil
}

// Outbox returns the outbox rc reconciles.
func (rc *Reconciler) Outbox() *Outbox { return rc.ob }

// ReconcileReport is what one Reconcile call did.
type ReconcileReport struct {
	// Checked counts the messages asked about, and those with headers
	// that could not be read (reported, never asked).
	Checked int
	// Applied counts messages the destination had applied, now StateApplied.
	Applied int
	// Requeued counts messages the destination had not applied, now due
	// for another send (dead ones with a fresh attempt budget).
	Requeued int
	// Rejected lists the idempotency keys of the messages the destination
	// refused for good (ErrRejected), now StateRejected; the refusal is in
	// each message's LastError.
	Rejected []string
	// Unresolved lists the messages left as they were, and why.
	Unresolved []Unresolved
	// Waiting lists the destinations this run did not ask, or stopped
	// asking, because an answer asked to wait (see Checker), each with the
	// end of its wait. Their messages not asked are in neither Unresolved
	// nor Checked, and keep their place for the next run.
	Waiting map[string]time.Time
	// OutOfTime says the run stopped before asking about every message it
	// read, as its activity's time was running out (see
	// RegisterReconciler): those not asked keep their place for the next
	// run.
	OutOfTime bool
	// NotListed counts the messages left out of Rejected and Unresolved in
	// the reconcile activity's result (see RegisterReconciler), which lists
	// at most 500 of each, with each LastError and Reason cut to 256
	// bytes, so that it stays under Temporal's limit on a payload (2 MB by
	// default) whatever MaxMessages and the destinations' errors. Reconcile
	// itself lists every one.
	NotListed int
}

// Bounds of the reconcile activity's result (see ReconcileReport.NotListed).
const (
	maxListed     = 500
	maxListedText = 256
)

// listed is rep as the reconcile activity returns it: Rejected and
// Unresolved cut to maxListed entries, and each entry's text to
// maxListedText bytes.
func (rep ReconcileReport) listed() ReconcileReport {
	if n := len(rep.Rejected) - maxListed; n > 0 {
		rep.Rejected, rep.NotListed = rep.Rejected[:maxListed], rep.NotListed+n
	}
	if n := len(rep.Unresolved) - maxListed; n > 0 {
		rep.Unresolved, rep.NotListed = rep.Unresolved[:maxListed], rep.NotListed+n
	}
	unresolved := make([]Unresolved, len(rep.Unresolved))
	for i, u := range rep.Unresolved {
		u.LastError, u.Reason = cut(u.LastError, maxListedText), cut(u.Reason, maxListedText)
		unresolved[i] = u
	}
	rep.Unresolved = unresolved
	return rep
}

// cut is s cut to at most n bytes, at a rune boundary.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// reconcileActivity runs Reconcile and returns its report as listed.
func (rc *Reconciler) reconcileActivity(ctx context.Context) (ReconcileReport, error) {
	beat := func(checked int) { activity.RecordHeartbeat(ctx, checked) }
	if rc.checkTime > 0 {
		// Each check is bounded (an HTTPChecker's Timeout, which may be
		// longer than the sweeps' HeartbeatTimeout): heartbeat on a clock
		// too. An unbounded Checker that hangs is left to the timeout.
		var stop func()
		beat, stop = heartbeat.Start[int](ctx, cmp.Or(rc.beatEvery, sweepHeartbeatEvery))
		defer stop()
	}
	rep, err := rc.reconcile(ctx, sweepStop(ctx), beat)
	return rep.listed(), err
}

// Unresolved is a message the reconciler could not settle.
type Unresolved struct {
	// Key and Destination are the message's (see Message).
	Key         string
	Destination string
	// State is the message's state as the reconciler found it and left it:
	// StateDead, or StatePending or StateSending for a message sent and
	// not acknowledged.
	State State
	// Attempts counts the message's sends (as Delivery.Attempt); LastError
	// is the message's last recorded send error, empty if none is.
	Attempts  int
	LastError string
	// Reason says why: the check failed (unknown), or a dead message ran
	// out of re-queues, or it was first sent longer ago than KeyRetention
	// and not acknowledged since.
	Reason string
}

// Reconcile looks at up to MaxMessages messages that are dead, or pending
// or with an expired lease and unacknowledged for longer than UnackedAfter,
// asks their destinations, and settles them. Each change of state is
// conditional on the message's row being the version read, so a relay that
// sends it meanwhile wins, and the next run asks again.
func (rc *Reconciler) Reconcile(ctx context.Context) (ReconcileReport, error) {
	return rc.reconcile(ctx, time.Time{}, func(checked int) {
		if activity.IsActivity(ctx) {
			activity.RecordHeartbeat(ctx, checked)
		}
	})
}

// reconcile is Reconcile, calling beat with the count checked before each
// check; with a stopBy, it asks nothing once a check begun then could end
// after stopBy, and reports OutOfTime.
func (rc *Reconciler) reconcile(ctx context.Context, stopBy time.Time, beat func(checked int)) (rep ReconcileReport, err error) {
	ctx, span := rc.tracer.Start(ctx, "OutboxReconcile")
	defer func() {
		span.SetAttributes(
			attrInt("dedup.outbox.reconcile.checked", rep.Checked),
			attrInt("dedup.outbox.reconcile.applied", rep.Applied),
			attrInt("dedup.outbox.reconcile.requeued", rep.Requeued),
			attrInt("dedup.outbox.reconcile.rejected", len(rep.Rejected)),
			attrInt("dedup.outbox.reconcile.unresolved", len(rep.Unresolved)),
			attrInt("dedup.outbox.reconcile.waiting", len(rep.Waiting)))
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()
	t := rc.ob.table
	// Destinations that asked to wait are left out, so that their messages
	// cannot take the run's MaxMessages places from the others'.
	rep.Waiting = rc.waits.active(time.Now())
	queried := time.Now() // no later than the query's now()
	rows, err := rc.ob.pool.Query(ctx, `SELECT id, idempotency_key, destination, name, headers, payload, attempts, requeues, state, coalesce(last_error, ''),
  unacked_since, xmin::text, now()
FROM `+t+`
WHERE (state = 'dead'
   OR (state = 'pending' AND unacked_since < now() - make_interval(secs => $1))
   OR (state = 'sending' AND lease_until < now() AND unacked_since < now() - make_interval(secs => $1)))
  AND destination <> ALL($4::text[])
ORDER BY (state = 'dead' AND requeues >= $3), checked_at NULLS FIRST, id LIMIT $2`, rc.cfg.UnackedAfter.Seconds(), rc.cfg.MaxMessages, rc.cfg.MaxRequeues, destinations(rep.Waiting))
	if err != nil {
		return rep, fmt.Errorf("outbox: reconcile: %w", translate(err))
	}
	// The query's now() was read no later than this, by the database's
	// clock: readNow plus the time from readAt to a question is no later
	// than the question, by the same clock; readNow plus the time from
	// queried to an answer is no earlier than the answer.
	readAt := time.Now()
	var readNow time.Time
	type candidate struct {
		d          Delivery
		requeues   int
		state      State
		lastError  string
		unreadable error      // why the headers could not be read
		unacked    *time.Time // when its first send not acknowledged since began (nil: never sent)
		version    string     // the row version read (xmin), which any change of the row replaces
	}
	var cands []candidate
	for rows.Next() {
		var c candidate
		var state string
		var headers []byte
		if err := rows.Scan(&c.d.ID, &c.d.Key, &c.d.Destination, &c.d.Name, &headers, &c.d.Payload, &c.d.Attempt, &c.requeues, &state, &c.lastError, &c.unacked, &c.version, &readNow); err != nil {
			rows.Close()
			return rep, fmt.Errorf("outbox: reconcile: %w", err)
		}
		c.state = State(state)
		// As the relay reads them (see claim): a row another producer wrote
		// with headers that are not an object of strings is reported alone,
		// instead of failing every run.
		if err := json.Unmarshal(headers, &c.d.Headers); err != nil {
			c.unreadable = err
		}
		cands = append(cands, c)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return rep, fmt.Errorf("outbox: reconcile: %w", translate(err))
	}
	// Dead letters out of re-queues come last, so they cannot crowd out
	// the messages a run can still settle; among the rest, those a run
	// could not settle (checked_at set) come after those not yet asked, so
	// messages whose check never gets an answer do not either. The
	// unresolved are marked checked in one statement as the run ends.
	var unsettled []int64
	defer func() {
		if len(unsettled) == 0 {
			return
		}
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, uerr := rc.ob.pool.Exec(uctx, `UPDATE `+t+` SET checked_at = now() WHERE id = ANY($1)`, unsettled); uerr != nil {
			err = errors.Join(err, fmt.Errorf("outbox: reconcile: mark unresolved messages checked: %w", translate(uerr)))
		}
	}()
	for _, c := range cands {
		if ctx.Err() != nil {
			return rep, ctx.Err()
		}
		if !stopBy.IsZero() && time.Now().Add(rc.checkTime).After(stopBy) {
			rep.OutOfTime = true
			break
		}
		if _, ok := rep.Waiting[c.d.Destination]; ok {
			// An earlier answer of this run asked to wait: not asked, and
			// not marked checked, so it keeps its place.
			continue
		}
		beat(rep.Checked) // each check may take the Checker's timeout
		rep.Checked++
		unresolved := func(reason string) {
			rep.Unresolved = append(rep.Unresolved, Unresolved{Key: c.d.Key, Destination: c.d.Destination, State: c.state,
				Attempts: c.d.Attempt, LastError: c.lastError, Reason: reason})
			rc.count(ctx, actionUnresolved, c.d.Destination)
			unsettled = append(unsettled, c.d.ID)
		}
		if c.unreadable != nil {
			unresolved("never sent: its headers are not a JSON object of strings: " + c.unreadable.Error())
			continue
		}
		asked := readNow.Add(time.Since(readAt)) // the question's time at the latest, by the database's clock
		applied, cerr := rc.check(ctx, c.d)
		rejected := errors.Is(cerr, ErrRejected)
		if wait := destinationWait(cerr); wait > 0 && !rejected {
			// Kept even if the run stops now: the answer came (as the
			// relay keeps a wait learned as it stops).
			if rep.Waiting == nil {
				rep.Waiting = map[string]time.Time{}
			}
			rep.Waiting[c.d.Destination] = rc.waits.set(c.d.Destination, time.Now().Add(min(wait, rc.cfg.MaxWait)))
		}
		if cerr != nil && ctx.Err() != nil {
			// The run was stopped, not answered: the message is neither
			// reported nor marked checked, which would send it behind
			// the others for a reason that is not its destination's.
			rep.Checked--
			return rep, ctx.Err()
		}
		if cerr != nil && !rejected {
			unresolved("unknown: " + cerr.Error())
			continue
		}
		// Decided at the answer, not at the query: the run's checks before
		// this one may have taken longer than what was left of
		// KeyRetention, and a destination that forgot the key by its answer
		// says "not applied" of a message it applied.
		answered := readNow.Add(time.Since(queried)) // no earlier than the answer, by the database's clock
		keyMayBeGone := c.unacked != nil && answered.Sub(*c.unacked) > rc.cfg.KeyRetention
		// Each change is made only to the row version read: state and
		// attempts alone can come back as they were (a relay that stops
		// mid-send gives the message back with its attempt uncounted), and
		// the answer says nothing of a send made since it was asked for.
		var sql string
		args := []any{c.d.ID, string(c.state), c.d.Attempt, c.version}
		const as = `WHERE id = $1 AND state = $2 AND attempts = $3 AND xmin::text = $4`
		switch {
		case rejected:
			sql = `UPDATE ` + t + ` SET state = 'rejected', settled_at = now(), lease_until = NULL, unacked_since = NULL, in_send = false, last_error = $5
` + as
			args = append(args, errorText(cerr))
		case applied:
			sql = `UPDATE ` + t + ` SET state = 'applied', settled_at = now(), lease_until = NULL, unacked_since = NULL, in_send = false
` + as
		case keyMayBeGone:
			unresolved(fmt.Sprintf("not applied at the destination by its answer, but first sent more than KeyRetention (%s) ago and not acknowledged since: the destination may have applied it and forgotten its key, so it is not re-queued (settle it by hand: docs/outbox.md, Dead letters)", rc.cfg.KeyRetention))
			continue
		case c.state == StateDead && c.requeues >= rc.cfg.MaxRequeues:
			unresolved(fmt.Sprintf("not applied at the destination; dead after %d re-queues (settle it by hand: docs/outbox.md, Dead letters)", c.requeues))
			continue
		// A re-queued message is unacknowledged from the question on: a
		// send the destination had not finished when asked (one that timed
		// out at the relay, which the destination went on with) may be
		// applied after the answer, and its key is kept from then on only.
		case c.state == StateDead:
			sql = `UPDATE ` + t + ` SET state = 'pending', requeues = requeues + 1, tries = 0, next_attempt_at = now(),
	settled_at = NULL, unacked_since = $5
` + as
			args = append(args, asked)
		default:
			// A lease under which no send began gives its try back, as
			// when a relay takes it over (see claim).
			sql = `UPDATE ` + t + ` SET state = 'pending', next_attempt_at = now(), lease_until = NULL, unacked_since = $5,
	tries = tries - (state = 'sending' AND NOT in_send)::int
` + as
			args = append(args, asked)
		}
		tag, err := rc.ob.pool.Exec(ctx, sql, args...)
		if err != nil {
			return rep, fmt.Errorf("outbox: reconcile %s: %w", c.d.Key, translate(err))
		}
		if tag.RowsAffected() == 0 {
			continue // changed meanwhile (a relay took it): the next run asks again
		}
		switch {
		case rejected:
			rep.Rejected = append(rep.Rejected, c.d.Key)
			rc.count(ctx, actionRejected, c.d.Destination)
		case applied:
			rep.Applied++
			rc.count(ctx, actionApplied, c.d.Destination)
		default:
			rep.Requeued++
			rc.count(ctx, actionRequeued, c.d.Destination)
		}
	}
	return rep, nil
}

// check asks the Checker about d. A panic in it is an unknown answer: the
// message is reported and marked checked, so that it goes behind the
// others, instead of the panic ending every run at the same message.
func (rc *Reconciler) check(ctx context.Context, d Delivery) (applied bool, err error) {
	defer func() {
		if p := recover(); p != nil {
			// Not wrapped: a panic is no answer, whatever error it carries.
			applied, err = false, fmt.Errorf("outbox: checker panicked: %v", p)
		}
	}()
	return rc.cfg.Checker.Applied(ctx, d)
}

func (rc *Reconciler) count(ctx context.Context, action, destination string) {
	rc.zero.destination(destination) // a destination not known up front: from its first count on
	rc.reconciled.Add(ctx, 1, metric.WithAttributes(ReconcileActionKey.String(action), DestinationKey.String(destination)))
}

func attrInt(k string, v int) attribute.KeyValue { return attribute.Key(k).Int(v) }
