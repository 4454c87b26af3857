package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"runtime/debug"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Defaults of RelayConfig.
const (
	DefaultBatchSize    = 16
	DefaultPollInterval = time.Second
	DefaultLease        = 30 * time.Second
	DefaultMaxAttempts  = 10
	DefaultMinBackoff   = time.Second
	DefaultMaxBackoff   = 5 * time.Minute
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Sender delivers the messages. Required; an *HTTPSender must come
	// from NewHTTPSender.
	Sender Sender

	// BatchSize is how many due messages one claim leases.
	//
	// Defaults to DefaultBatchSize (16).
	BatchSize int

	// PollInterval is how long Run waits after a pass that found nothing
	// due (or failed) before the next.
	//
	// Defaults to DefaultPollInterval (1s).
	PollInterval time.Duration

	// Lease is how long a claimed batch belongs to the relay that claimed
	// it. A relay that dies between send and acknowledgement leaves the
	// message leased; when the lease expires, any relay sends it again with
	// the same key. A relay cuts each send at its lease's end and gives
	// back the messages left with under a quarter of it, so no two relays
	// send one message at once; make it a few times the Sender's own
	// timeout (HTTPSenderConfig.Timeout) so sends are not cut short.
	// RegisterRelay takes a Lease of at most 28 minutes (see there); Run
	// and RunOnce take any.
	//
	// Defaults to DefaultLease (30s).
	Lease time.Duration

	// MaxAttempts is how many failed sends make a message dead (StateDead,
	// with its last error). A permanent error (ErrPermanent) makes it dead
	// at once. A send that panics is a failed one. So that a message whose
	// send stops the process (a crash, an out-of-memory kill) does not stop
	// every relay in turn, one whose sends began MaxAttempts times in a row
	// without recording an outcome is made dead without another send; a
	// recorded failure resets that count, a re-queue by the reconciler does
	// not.
	//
	// It bounds the failed sends, not all sends. Counted are the sends that
	// failed and those that stalled (began and recorded no outcome, their
	// lease taken over by another relay), since the message was enqueued
	// or last re-queued by the reconciler; the failure that brings the
	// count to MaxAttempts, or past it, makes the message dead. A stall is
	// counted, as the message may be what stopped its relay, but makes it
	// dead only as the MaxAttempts-th in a row: a message whose last try
	// stalled is sent again, so its failed and stalled sends number up to
	// 2 x MaxAttempts - 1. Tries given back are not counted at all: a send
	// cut off by a relay that stops (its context cancelled), and a claim
	// whose send never began (its lease taken over first, or the message
	// given back unsent). A relay stopping is not the destination failing,
	// so a shutdown on the last try does not make a dead letter; the send
	// again carries the same key, so the destination applies it once.
	//
	// Defaults to DefaultMaxAttempts (10).
	MaxAttempts int

	// MinBackoff and MaxBackoff bound the wait before a failed message's
	// next attempt: MinBackoff doubled per failure, capped at MaxBackoff,
	// with jitter (between half and all of it). A failure that asks for a
	// longer wait (RetryAfter, a StatusError's Retry-After) gets it, up to
	// MaxBackoff. So does its destination when the wait speaks for it (a
	// RetryAfter's, or a Retry-After on a 429 or a 503): until the wait is
	// over the relay sends it nothing, and gives the destination's messages
	// it holds back for after the wait, their try not counted
	// (RelayResult.Postponed). The wait is the Relay's own (each worker's),
	// not kept in the database.
	//
	// Default to DefaultMinBackoff (1s) and DefaultMaxBackoff (5m).
	MinBackoff, MaxBackoff time.Duration

	// KeyRetention is how long the destinations keep a message's
	// idempotency key after they receive it, as ReconcilerConfig's (set
	// each no longer than the destinations keep keys). A message first sent
	// longer ago than this, and not acknowledged since (its responses
	// lost, its sends failing, a relay down for a day), is made dead
	// instead of sent again: the destination may have applied it and
	// forgotten the key, and would apply it again. The reconciler reports
	// it for a person to settle (docs/outbox.md, Dead letters). The time
	// is taken as each send begins, so a message never sent is sent
	// whatever its age; for a message the reconciler re-queued, it is the
	// time of the reconciler's question, as a send the destination had not
	// finished then may be applied after it.
	//
	// Defaults to DefaultKeyRetention (23h).
	KeyRetention time.Duration

	// Logger receives Run's pass errors, a Sender's panics, messages it
	// could not give back (their leases expire instead), and a line each
	// time a destination asks the relay to wait (see MinBackoff).
	//
	// Defaults to slog.Default().
	Logger *slog.Logger

	// TracerProvider creates the tracer for the span of every send.
	//
	// Defaults to otel.GetTracerProvider().
	TracerProvider trace.TracerProvider

	// MeterProvider creates the meter for MetricDeliveries (the backlog
	// gauges are the Outbox's: Options.MeterProvider).
	//
	// Defaults to otel.GetMeterProvider().
	MeterProvider metric.MeterProvider

	// Destinations are the destinations whose MetricDeliveries series, one
	// per result, are made at zero when the Relay is made. PromQL's
	// increase() and rate() see no increase in a counter series that first
	// appears at 1, so a destination's first dead letter would show in
	// neither. A destination not listed has its series made by its first
	// send, whose own result does not show (it is most often delivered).
	//
	// Defaults to the Endpoints' destinations when Sender is an
	// *HTTPSender, else none.
	Destinations []string
}

func (c RelayConfig) withDefaults() RelayConfig {
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.Lease == 0 {
		c.Lease = DefaultLease
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.MinBackoff == 0 {
		c.MinBackoff = DefaultMinBackoff
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = DefaultMaxBackoff
	}
	if c.KeyRetention == 0 {
		c.KeyRetention = DefaultKeyRetention
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if s, ok := c.Sender.(*HTTPSender); ok && s != nil && c.Destinations == nil {
		c.Destinations = slices.Sorted(maps.Keys(s.cfg.Endpoints))
	}
	return c
}

func (c RelayConfig) validate() error {
	hs, isHTTP := c.Sender.(*HTTPSender)
	fn, isFunc := c.Sender.(SenderFunc)
	switch {
	case c.Sender == nil, isFunc && fn == nil:
		return fmt.Errorf("%w: RelayConfig.Sender is nil", ErrInvalidConfig)
	case isHTTP && (hs == nil || hs.cfg.Client == nil):
		// A nil one panics at every send; a zero one knows no destination,
		// and would make every message dead at once.
		return fmt.Errorf("%w: RelayConfig.Sender is an HTTPSender not made by NewHTTPSender", ErrInvalidConfig)
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("%w: RelayConfig.BatchSize must be between 1 and 10000, got %d", ErrInvalidConfig, c.BatchSize)
	case c.PollInterval < time.Millisecond:
		return fmt.Errorf("%w: RelayConfig.PollInterval must be at least 1ms, got %s", ErrInvalidConfig, c.PollInterval)
	case c.Lease < 100*time.Millisecond:
		return fmt.Errorf("%w: RelayConfig.Lease must be at least 100ms, got %s", ErrInvalidConfig, c.Lease)
	case c.MaxAttempts < 1:
		return fmt.Errorf("%w: RelayConfig.MaxAttempts must be at least 1, got %d", ErrInvalidConfig, c.MaxAttempts)
	case c.MinBackoff < time.Millisecond:
		return fmt.Errorf("%w: RelayConfig.MinBackoff must be at least 1ms, got %s", ErrInvalidConfig, c.MinBackoff)
	case c.MaxBackoff < c.MinBackoff:
		return fmt.Errorf("%w: RelayConfig.MaxBackoff (%s) must not be below MinBackoff (%s)", ErrInvalidConfig, c.MaxBackoff, c.MinBackoff)
	case c.KeyRetention < time.Second:
		return fmt.Errorf("%w: RelayConfig.KeyRetention must be 0 (the default) or at least 1s, got %s", ErrInvalidConfig, c.KeyRetention)
	}
	return nil
}

// Relay delivers an outbox's due messages through a Sender, at least once.
// Any number of relays (goroutines, processes) may run on one outbox: a
// message is leased by one relay at a time (claimed with FOR UPDATE SKIP
// LOCKED), and its lease fences the acknowledgement, so no two relays send
// one message concurrently unless a lease expires during a send.
//
// Run it as a loop in each worker process (Run), or from Temporal
// (RegisterRelay and EnsureRelaySchedule), or both.
type Relay struct {
	ob  *Outbox
	cfg RelayConfig
	tel *relayTelemetry

	// afterSend, when set (tests only), runs after a successful send and
	// before its acknowledgement; an error stops the pass there, as if the
	// relay had died.
	afterSend func(Delivery) error
	// beforeBegin, when set (tests only), runs before a send begins; an
	// error stops the pass there, the message left leased, as if the relay
	// had died.
	beforeBegin func(Delivery) error
	// beatEvery, when set (tests only), replaces sweepHeartbeatEvery.
	beatEvery time.Duration

	waits waits // destinations that asked for a wait
}

// NewRelay returns a Relay for ob. cfg is checked; an error names the field
// at fault and wraps ErrInvalidConfig.
func NewRelay(ob *Outbox, cfg RelayConfig) (*Relay, error) {
	if ob == nil {
		return nil, fmt.Errorf("%w: Outbox is nil", ErrInvalidConfig)
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	tel, err := newRelayTelemetry(cfg.TracerProvider, cfg.MeterProvider, cfg.Destinations)
	if err != nil {
		return nil, err
	}
	return &Relay{ob: ob, cfg: cfg, tel: tel}, nil
}

// Outbox returns the relay's outbox.
func (r *Relay) Outbox() *Outbox { return r.ob }

// RelayResult is what one pass of a relay did.
type RelayResult struct {
	// Delivered counts messages the destination accepted.
	Delivered int
	// Retried counts failed sends scheduled for another attempt.
	Retried int
	// Dead counts messages that became dead in this pass.
	Dead int
	// LeaseLost counts messages whose lease ended before the send began
	// (this relay did not send it), or ended and was taken by another relay
	// before the acknowledgement (the message was sent twice, with the same
	// key).
	LeaseLost int
	// Postponed counts messages not sent because their destination asked
	// for a wait (see RelayConfig.MinBackoff): due again after it, their
	// try not counted.
	Postponed int
	// OutOfTime says the pass stopped early, as its activity's time was
	// running out (see RegisterRelay): messages due at its start may be
	// left, for the next run.
	OutOfTime bool
}

// Run delivers due messages until ctx is done, then returns nil. Errors of
// a pass (the database unreachable, say) are logged and retried after
// PollInterval. To stop it, cancel ctx and wait for Run to return before
// closing the pool: on the way out it gives back the messages it leased
// and has not sent.
func (r *Relay) Run(ctx context.Context) error {
	for {
		res, err := r.RunOnce(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			r.cfg.Logger.Warn("outbox relay pass failed", "error", err)
		}
		if err != nil || res == (RelayResult{}) {
			t := time.NewTimer(r.cfg.PollInterval)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil
			case <-t.C:
			}
		}
	}
}

// RunOnce delivers the messages due when it starts (pending and due, or
// leased by a relay whose lease has expired), batch by batch, and returns
// what it did. Messages that fail in the pass are not retried in it.
func (r *Relay) RunOnce(ctx context.Context) (RelayResult, error) {
	return r.runOnce(ctx, nil, time.Time{})
}

// runOnce is RunOnce, calling progress after each message. With a stopBy,
// it claims no batch whose lease would end after it: the pass ends by then
// (a batch's sends are cut at its lease's end), with OutOfTime set.
func (r *Relay) runOnce(ctx context.Context, progress func(RelayResult), stopBy time.Time) (RelayResult, error) {
	var res RelayResult
	var passStart time.Time
	if err := r.ob.pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&passStart); err != nil {
		return res, fmt.Errorf("outbox: relay: %w", err)
	}
	for {
		// The lease's end by this process's clock, taken before the claim:
		// it comes no later than the end the database records, whatever
		// the two clocks say.
		leaseEnd := time.Now().Add(r.cfg.Lease)
		if !stopBy.IsZero() && leaseEnd.After(stopBy) {
			res.OutOfTime = true
			return res, nil
		}
		batch, err := r.claim(ctx, passStart, destinations(r.waits.active(time.Now())))
		if err != nil {
			return res, err
		}
		var postponed []Delivery // given back with the rest, in one statement
		for i, d := range batch {
			// Once the lease is over another relay may claim and send the
			// message: each send is cut at the lease's end, and messages
			// left with too little of it go back for the next claim.
			if time.Until(leaseEnd) < r.cfg.Lease/4 {
				r.release(ctx, append(postponed, batch[i:]...))
				if i == 0 {
					// The claim itself took most of the lease (a slow
					// database): claiming again at once would spin on the
					// same messages. The pass ends; Run waits before the
					// next.
					return res, nil
				}
				postponed = nil
				break
			}
			if _, ok := r.waits.until(d.Destination, time.Now()); ok {
				// An earlier send of the batch learned that its destination
				// asks for a wait: given back, due after it.
				postponed = append(postponed, d)
				res.Postponed++
			} else if err := r.deliver(ctx, leaseEnd, d, &res); err != nil {
				// Release the rest of the batch for other relays: their
				// leases would otherwise have to expire.
				r.release(ctx, append(postponed, batch[i+1:]...))
				return res, err
			}
			if progress != nil {
				progress(res)
			}
		}
		r.release(ctx, postponed)
		if len(batch) < r.cfg.BatchSize {
			return res, nil
		}
	}
}

// claim leases up to BatchSize due messages, none for the destinations
// skipped (they asked for a wait). Taking over an expired lease under which
// no send began (its relay stopped before reaching the message) gives that
// lease's try back; one under which a send began and recorded nothing
// counts a stall (see begin).
func (r *Relay) claim(ctx context.Context, passStart time.Time, skipped []string) ([]Delivery, error) {
	t := r.ob.table
	rows, err := r.ob.pool.Query(ctx, `UPDATE `+t+` SET state = 'sending', attempts = attempts + 1,
	tries = tries + 1 - (state = 'sending' AND NOT in_send)::int,
	stalls = stalls + in_send::int, in_send = false,
	lease_until = clock_timestamp() + make_interval(secs => $2)
WHERE id = ANY (ARRAY(
	SELECT id FROM `+t+`
	WHERE ((state = 'pending' AND next_attempt_at <= $3) OR (state = 'sending' AND lease_until <= $3))
		AND destination <> ALL($4::text[])
	ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED))
RETURNING id, idempotency_key, destination, name, headers, payload, attempts, tries, stalls`,
		r.cfg.BatchSize, r.cfg.Lease.Seconds(), passStart, skipped)
	if err != nil {
		return nil, fmt.Errorf("outbox: relay: claim: %w", translate(err))
	}
	defer rows.Close()
	var out []Delivery
	for rows.Next() {
		var d Delivery
		var headers []byte
		if err := rows.Scan(&d.ID, &d.Key, &d.Destination, &d.Name, &headers, &d.Payload, &d.Attempt, &d.tries, &d.stalls); err != nil {
			return nil, fmt.Errorf("outbox: relay: claim: %w", err)
		}
		// Enqueue writes an object of strings; a row another producer wrote
		// may hold any JSON. Such a message fails alone (dead), instead of
		// failing every claim of the batch it is in.
		if err := json.Unmarshal(headers, &d.Headers); err != nil {
			d.unreadable = fmt.Errorf("%w: its headers are not a JSON object of strings: %w", ErrPermanent, err)
		}
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox: relay: claim: %w", translate(err))
	}
	return out, nil
}

// errRelayStopped: the relay stopped between send and acknowledgement.
var errRelayStopped = errors.New("outbox: relay stopped before acknowledging a send")

// deliver sends one leased message, within its lease, and records what
// happened. It returns an error only when the pass must stop.
func (r *Relay) deliver(ctx context.Context, leaseEnd time.Time, d Delivery, res *RelayResult) error {
	ctx, span := r.tel.startSend(ctx, d)
	sendCtx, cancelSend := context.WithDeadline(ctx, leaseEnd)
	sendErr := d.unreadable
	if sendErr == nil && d.stalls >= r.cfg.MaxAttempts {
		// Its sends keep stopping the relay's process (a crash, an
		// out-of-memory kill on this message): not sent again.
		sendErr = fmt.Errorf("%w: %d sends of it in a row began and never recorded an outcome: the relay's process stopped during each, or each outlasted its lease (MaxAttempts %d)", ErrPermanent, d.stalls, r.cfg.MaxAttempts)
	}
	if sendErr == nil && r.beforeBegin != nil {
		if err := r.beforeBegin(d); err != nil {
			cancelSend()
			r.tel.endSend(ctx, span, d, resultStopped, err)
			return fmt.Errorf("outbox: relay stopped before a send: %w", err)
		}
	}
	if sendErr == nil {
		held, unacked, err := r.begin(ctx, d)
		switch {
		case err != nil:
			cancelSend()
			r.release(ctx, []Delivery{d})
			r.tel.endSend(ctx, span, d, resultStopped, err)
			return err
		case !held:
			cancelSend()
			res.LeaseLost++ // its lease ended (and another relay may have taken it): not sent
			r.tel.endSend(ctx, span, d, resultLeaseLost, nil)
			return nil
		case unacked > r.cfg.KeyRetention:
			// An earlier send may have been applied, its answer lost, and
			// its key forgotten since.
			sendErr = fmt.Errorf("%w: first sent %s ago and not acknowledged since, longer than the destinations keep keys (KeyRetention %s): it may have been applied and its key forgotten, so it is not sent again (settle it by hand: docs/outbox.md, Dead letters)",
				ErrPermanent, unacked.Round(time.Second), r.cfg.KeyRetention)
		default:
			sendErr = r.send(sendCtx, d)
			if wait := destinationWait(sendErr); wait > 0 {
				until := r.waits.set(d.Destination, time.Now().Add(min(wait, r.cfg.MaxBackoff)))
				r.cfg.Logger.Info("outbox destination asked to wait: nothing is sent to it until then",
					"destination", d.Destination, "until", until.UTC().Format(time.RFC3339), "asked", wait.String(), "key", d.Key)
			}
		}
	}
	cancelSend()
	if sendErr != nil && ctx.Err() != nil {
		// The relay is stopping, not the destination failing: give the
		// message back without counting the try.
		r.release(ctx, []Delivery{d})
		r.tel.endSend(ctx, span, d, resultStopped, sendErr)
		return ctx.Err()
	}
	if sendErr == nil && r.afterSend != nil {
		if err := r.afterSend(d); err != nil {
			r.tel.endSend(ctx, span, d, resultStopped, err)
			return fmt.Errorf("%w: %w", errRelayStopped, err)
		}
	}
	// Record the outcome even if ctx was cancelled during the send, so the
	// lease does not have to expire.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var result string
	var tag int64
	var err error
	switch {
	case sendErr == nil:
		result = resultDelivered
		tag, err = r.ack(rctx, d)
	case errors.Is(sendErr, ErrPermanent) || d.tries >= r.cfg.MaxAttempts:
		result = resultDead
		tag, err = r.fail(rctx, d, StateDead, 0, sendErr)
	default:
		result = resultRetried
		tag, err = r.fail(rctx, d, StatePending, min(max(r.backoff(d.tries), waitAsked(sendErr)), r.cfg.MaxBackoff), sendErr)
	}
	if err != nil {
		// Not recorded: the message is still leased, and is sent again
		// after its lease. The pass stops here.
		r.tel.endSend(ctx, span, d, resultStopped, errors.Join(sendErr, err))
		return err
	}
	if tag == 0 {
		result = resultLeaseLost
	}
	switch result {
	case resultDelivered:
		res.Delivered++
	case resultRetried:
		res.Retried++
	case resultDead:
		res.Dead++
	case resultLeaseLost:
		res.LeaseLost++
	}
	r.tel.endSend(ctx, span, d, result, sendErr)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return nil
}

// begin records that d's send begins (see the in_send column), and from
// when the message is unacknowledged (unacked_since: its first send, or
// its first since it was acknowledged; since the question, for one the
// reconciler re-queued, and since the Requeue, for one a person re-queued
// after a send), if this relay still holds its lease and the lease has not
// ended; false when it has (the message is not sent: the next claim takes
// it, giving the try back). unacked is how long
// ago, by the database's clock, that first send began (0 for this one).
// The commit does not wait for the disk: a begin lost in a crash of the
// database (within the WAL writer's delay) misses a stall and, for a first
// send, its time, so that the message counts as unacknowledged from its
// next send, later by that much.
func (r *Relay) begin(ctx context.Context, d Delivery) (held bool, unacked time.Duration, err error) {
	var secs float64
	err = r.ob.pool.QueryRow(ctx, `UPDATE `+r.ob.table+` SET in_send = true, unacked_since = coalesce(unacked_since, clock_timestamp())
WHERE id = $1 AND state = 'sending' AND attempts = $2 AND lease_until > clock_timestamp()
	AND set_config('synchronous_commit', 'off', true) IS NOT NULL
RETURNING extract(epoch FROM clock_timestamp() - unacked_since)::float8`, d.ID, d.Attempt).Scan(&secs)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return false, 0, nil
	case err != nil:
		return false, 0, fmt.Errorf("outbox: relay: begin sending %s: %w", d.Key, translate(err))
	}
	return true, time.Duration(secs * float64(time.Second)), nil
}

// send calls the Sender; a panic in it is a failed send (retried, then
// dead after MaxAttempts), not the end of the process running the relay.
func (r *Relay) send(ctx context.Context, d Delivery) (err error) {
	defer func() {
		if p := recover(); p != nil {
			r.cfg.Logger.Error("outbox sender panicked", "key", d.Key, "panic", p, "stack", string(debug.Stack()))
			if perr, ok := p.(error); ok {
				err = fmt.Errorf("outbox: sender panicked: %w", perr)
			} else {
				err = fmt.Errorf("outbox: sender panicked: %v", p)
			}
		}
	}()
	return r.cfg.Sender.Send(ctx, d)
}

// ack marks d sent, if this relay still holds its lease (attempts is the
// fencing token: a relay that re-claimed it has incremented it).
func (r *Relay) ack(ctx context.Context, d Delivery) (int64, error) {
	tag, err := r.ob.pool.Exec(ctx, `UPDATE `+r.ob.table+` SET state = 'sent', settled_at = now(), in_send = false,
	lease_until = NULL, unacked_since = NULL, last_error = NULL
WHERE id = $1 AND state = 'sending' AND attempts = $2`, d.ID, d.Attempt)
	if err != nil {
		return 0, fmt.Errorf("outbox: relay: acknowledge %s: %w", d.Key, translate(err))
	}
	return tag.RowsAffected(), nil
}

// fail records a failed send: pending again after backoff, or dead.
// A failed send resets the stalls (they count in a row); one made dead for
// its stalls keeps them, so that a re-queue by the reconciler makes it dead
// again without a send.
func (r *Relay) fail(ctx context.Context, d Delivery, state State, backoff time.Duration, sendErr error) (int64, error) {
	stalled := d.stalls >= r.cfg.MaxAttempts
	tag, err := r.ob.pool.Exec(ctx, `UPDATE `+r.ob.table+` SET state = $3, in_send = false,
	stalls = CASE WHEN $6 THEN stalls ELSE 0 END,
	next_attempt_at = now() + make_interval(secs => $4), lease_until = NULL, last_error = $5,
	settled_at = CASE WHEN $3 = 'dead' THEN now() END
WHERE id = $1 AND state = 'sending' AND attempts = $2`, d.ID, d.Attempt, string(state), backoff.Seconds(), errorText(sendErr), stalled)
	if err != nil {
		return 0, fmt.Errorf("outbox: relay: record failure of %s: %w", d.Key, translate(err))
	}
	return tag.RowsAffected(), nil
}

// release gives leased messages back without counting their attempt. One
// whose send began under this lease (a relay stopping mid-send) stays
// unacknowledged since then: the send may have reached the destination. A
// message whose destination asked this relay for a wait is due no sooner
// than its end, whichever path gives it back, so that other relays, which
// do not know the wait, do not send it meanwhile. The end is turned into
// the database's clock (the claims compare next_attempt_at with it), not
// written as this process's.
func (r *Relay) release(ctx context.Context, batch []Delivery) {
	if len(batch) == 0 {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	ids := make([]int64, len(batch))
	attempts := make([]int32, len(batch))
	waits := make([]float64, len(batch)) // seconds left of the destination's wait; 0 for none
	now := time.Now()
	for i, d := range batch {
		ids[i], attempts[i] = d.ID, int32(d.Attempt)
		if until, ok := r.waits.until(d.Destination, now); ok {
			waits[i] = until.Sub(now).Seconds()
		}
	}
	_, err := r.ob.pool.Exec(rctx, `UPDATE `+r.ob.table+` o SET state = 'pending', attempts = o.attempts - 1, tries = o.tries - 1, in_send = false, lease_until = NULL,
	next_attempt_at = greatest(o.next_attempt_at, clock_timestamp() + make_interval(secs => nullif(l.wait, 0)))
FROM unnest($1::bigint[], $2::int[], $3::float8[]) AS l(id, attempts, wait)
WHERE o.id = l.id AND o.state = 'sending' AND o.attempts = l.attempts`, ids, attempts, waits)
	if err != nil {
		// Their leases expire instead, and another pass takes them.
		r.cfg.Logger.Warn("outbox relay could not give leased messages back", "messages", len(batch), "error", translate(err))
	}
}

// backoff is the wait after the tries-th failed send.
func (r *Relay) backoff(tries int) time.Duration {
	b := r.cfg.MinBackoff
	for i := 1; i < tries && b < r.cfg.MaxBackoff; i++ {
		if b > r.cfg.MaxBackoff/2 {
			b = r.cfg.MaxBackoff // doubled, it would pass the cap, or overflow past time.Duration's range
		} else {
			b *= 2
		}
	}
	return b/2 + rand.N(b/2+1)
}
