package dedupactivity

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.temporal.io/sdk/activity"
)

// ErrNotClaimed is returned by Claim.Complete on a claim that did not claim
// its event (a duplicate), or that was completed already.
var ErrNotClaimed = errors.New("dedupactivity: Complete on a claim that did not claim its event, or twice")

// Claim is an event claimed inside a transaction the caller owns; see
// ClaimTx.
type Claim[Out any] struct {
	d       *Deduper
	tx      pgx.Tx
	m       *marker
	info    activity.Info
	id      Identity
	outcome Outcome
	stored  Out
	done    bool
}

// ClaimTx claims the event id inside tx, a transaction the caller began and
// commits itself: the lower-level form for code that already opens its own
// transaction (as River's JobCompleteTx completes a job inside the caller's).
// in is the event's input, compared with the first delivery's for business
// keys as in WithBusinessKey.
//
// When the Claim's Outcome is OutcomeClaimed, apply the effect through tx,
// call Complete with its result, and commit tx: the marker commits with the
// effect or not at all. Otherwise (OutcomeDuplicate, or
// OutcomePayloadMismatch under MismatchReturnStored) the event was applied
// before: write nothing, and return Stored. A rejected mismatch is an error
// wrapping ErrPayloadMismatch.
//
// The claim inserts the marker right away, so a concurrent attempt of the
// same event waits (at most Options.ClaimWait) until tx ends. Call Complete
// through the same tx before it ends: on a savepoint, before releasing it.
// Committing tx without Complete marks the event without a result: later
// deliveries fail with ErrTxEnded (with Options.DiscardResults, they are
// duplicates). Any isolation level works; under REPEATABLE READ and
// SERIALIZABLE a concurrent commit of the same event is a serialization
// failure (SQLSTATE 40001) that the caller retries as usual. The
// partitioned layout is not supported (its key is the activity's
// ScheduledTime).
func ClaimTx[Out any](ctx context.Context, d *Deduper, tx pgx.Tx, id Identity, in any) (_ *Claim[Out], err error) {
	if !d.made() {
		return nil, fmt.Errorf("%w: Deduper is nil, or not made by New", ErrInvalidOptions)
	}
	info := infoFor(ctx, id)
	var m *marker
	switch {
	case tx == nil:
		err = fmt.Errorf("%w: tx is nil", ErrInvalidOptions)
	case d.opts.PartitionInterval > 0:
		err = fmt.Errorf("%w: ClaimTx does not support the partitioned layout (PartitionInterval)", ErrInvalidOptions)
	default:
		m, err = d.newMarker(info, id, d.opts.Retention)
	}
	if err != nil {
		d.tel.failed(ctx, info, id, nil, err) // traced and counted as the claims are
		return nil, err
	}
	c := &Claim[Out]{d: d, tx: tx, info: info, id: id, m: m}

	ctx, rec := d.tel.start(ctx, info, id, m.sum)
	a := attempt{outcome: OutcomeError}
	defer func() {
		rec.set(a)
		d.tel.end(ctx, rec, err) // err is the result: every return is traced as it is
	}()
	if err = fingerprintInput(m, id, in); err != nil {
		rec.noClaim = true // failed before its claim: no claim duration
		return nil, err
	}
	start := time.Now()
	b := &pgx.Batch{}
	d.store.queueClaim(b, c.m, d.claimWaitFor(ctx, c.m))
	br := tx.SendBatch(ctx, b)
	claimed, err := d.store.readClaim(br, c.m)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	a.claimWait = time.Since(start)
	if err != nil {
		err = claimError(ctx, err)
		if errors.Is(err, ErrClaimTimeout) {
			a.outcome = OutcomeClaimTimeout
		}
		return nil, err
	}
	if claimed {
		a.outcome, c.outcome = OutcomeClaimed, OutcomeClaimed
		if conn := tx.Conn(); conn != nil {
			stateOf(conn).claimOpen(c.m.sum, c.m.xact, c.m.xmin)
		}
		return c, nil
	}
	// A duplicate: a new statement of this transaction reads the committed
	// marker (READ COMMITTED takes a new snapshot; under the stricter levels
	// the claim has failed already if the marker is not visible).
	b = &pgx.Batch{}
	b.Queue(d.store.restoreLockTimeout) // the caller's transaction goes on
	d.store.queueRead(b, c.m)
	br = tx.SendBatch(ctx, b)
	_, rerr := br.Exec()
	var st stored
	found := false
	if rerr == nil {
		st, found, rerr = scanStored(br)
	}
	if cerr := br.Close(); rerr == nil {
		rerr = cerr
	}
	// With results discarded every marker holds an empty result, completed
	// or not: only the connection, which remembers the claims made in its
	// transaction and not completed (ClaimTx's, and that of a wrapper whose
	// effect this may run in), can tell this transaction's own.
	var openIn string
	if conn := tx.Conn(); conn != nil {
		openIn = stateOf(conn).openIn(c.m.sum, st.xmin)
	}
	if rerr == nil && found && (st.result == nil || d.opts.DiscardResults && openIn != "") {
		// No result yet: the marker may be this very transaction's, from an
		// earlier claim of the same event not completed yet (a ClaimTx's,
		// or the wrapper's whose effect this runs in): the row's xmin says
		// so, or, when that claim ran in a savepoint, whose subtransaction
		// wrote the row, the connection remembers it.
		var xact *string
		if err := tx.QueryRow(ctx, currentXactSQL).Scan(&xact); err == nil && xact != nil &&
			(st.result == nil && sameXact(*xact, st.xmin) || openIn == *xact) {
			return nil, errors.New("dedupactivity: the event is already claimed in this transaction, and not completed: Complete that claim, or claim each event once per transaction")
		}
	}
	if a, err = d.judge(c.m, st, found, rerr, a); err != nil {
		return nil, err
	}
	c.outcome = a.outcome
	if len(a.result) > 0 {
		if err = decodeResult(d.resultConverter(ctx, info, id), a.result, &c.stored); err != nil {
			a.outcome = OutcomeError
			return nil, err
		}
	}
	return c, nil
}

// Outcome says what the claim found: OutcomeClaimed (apply the effect, then
// Complete), OutcomeDuplicate, or OutcomePayloadMismatch under
// MismatchReturnStored.
func (c *Claim[Out]) Outcome() Outcome { return c.outcome }

// Stored is the first delivery's result, when the outcome is not
// OutcomeClaimed (the zero value when results are discarded). After a
// Complete that succeeded it is the result passed to Complete as the data
// converter decodes it from what was stored, which is what a duplicate
// gets: return it, not your own value, for both to return one value (a
// converter's round trip changes some: an int64 in an any comes back a
// float64). It is the value passed to Complete when results are discarded.
func (c *Claim[Out]) Stored() Out { return c.stored }

// Complete records the effect's result in the marker, in the claim's
// transaction; commit the transaction after it. It fails with ErrNotClaimed
// on a duplicate or after a Complete that succeeded, with ErrEncoding (and
// nothing stored) when the data converter cannot encode result or decode
// what it encoded (a duplicate could not read it), with pgx.ErrTxClosed
// after tx was committed or rolled back, and with ErrTxEnded when SQL sent
// on tx ended the claim's transaction (another now runs there). One that
// failed may be called again (it fails again once the transaction is
// aborted). A Complete that fails, but for ErrNotClaimed, is traced and
// counted as an attempt of its own under OutcomeError with its error.type
// (the claim was counted as claimed when ClaimTx made it).
func (c *Claim[Out]) Complete(ctx context.Context, result Out) (err error) {
	if c.outcome != OutcomeClaimed || c.done {
		return ErrNotClaimed
	}
	defer func() {
		if err != nil {
			c.d.tel.failed(ctx, c.info, c.id, c.m.sum[:], err)
		}
	}()
	dc := c.d.resultConverter(ctx, c.info, c.id)
	b, err := c.d.encodeResult(dc, result)
	if err != nil {
		return err
	}
	stored, err := asStored(dc, b, result) // as a duplicate gets it (see Stored)
	if err != nil {
		return err
	}
	c.m.result = b
	batch := &pgx.Batch{}
	c.d.store.queueComplete(batch, c.m, !c.d.opts.DiscardResults)
	br := c.tx.SendBatch(ctx, batch)
	found, err := readComplete(br)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	switch {
	case err != nil:
		return fmt.Errorf("dedupactivity: store result: %w", interpretError(err, false)) // ErrTxEnded: not the claim's transaction
	case !found:
		return fmt.Errorf("%w: the marker row was changed in the transaction", ErrTxEnded)
	}
	c.done = true // only now: one that failed (its context done before it was sent, say) may be called again
	c.stored = stored
	// The transaction is the claim's and still open, so its connection is
	// this goroutine's (after Commit or Rollback a pool may have handed it
	// to another, and the batch above failed).
	if conn := c.tx.Conn(); conn != nil {
		stateOf(conn).completed(c.m.sum)
	}
	return nil
}
