package dedupactivity

// This file holds the claim logic: one PostgreSQL transaction that claims
// the event identity and, only if the claim is new, applies the effect and
// stores its result. Marker and effect commit or roll back together.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// event is one delivery of an event, ready to claim.
type event struct {
	id           Identity
	enc          []byte   // id.Encode()
	hash         [32]byte // sha256(enc), the primary key
	fingerprint  []byte
	activityType string
	attempt      int32
	retention    time.Duration
	minExpiry    time.Time // the activity's own redelivery bound; zero if none
}

// applyFunc runs the user's effect through tx and returns the encoded result
// to store (nil stores none). An error from the effect itself must be
// wrapped in effectError so it is reported as such.
type applyFunc func(ctx context.Context, tx pgx.Tx) ([]byte, error)

// effectError marks an error returned by the user's effect: it is returned to
// Temporal unchanged.
type effectError struct{ err error }

func (e effectError) Error() string { return e.err.Error() }
func (e effectError) Unwrap() error { return e.err }

// stored is the marker row of an event that was already applied.
type stored struct {
	fingerprint []byte
	alg         int16
	result      []byte
	attempt     int32
}

// apply claims ev and runs fn in the same transaction. It returns the result
// to hand back: the new one when this attempt claimed the event, the stored
// one when it was a duplicate. rec.outcome says which.
//
// The steps, in one READ COMMITTED transaction:
//
//  1. BEGIN.
//  2. One pipelined round trip: bound lock_timeout by the claim wait, INSERT
//     the marker ON CONFLICT DO NOTHING RETURNING, restore lock_timeout, and
//     read the marker row. If a concurrent attempt holds the same identity,
//     the INSERT waits for its transaction: if it commits, the INSERT returns
//     no row and the read (a new snapshot) sees the committed marker; if it
//     rolls back, the INSERT claims the event.
//  3. Claimed: run the effect through the same tx, store its result, COMMIT.
//     Any error or panic rolls everything back, marker included, so the
//     event stays available for the retry.
//  4. Duplicate: compare fingerprints, ROLLBACK (nothing was written) and
//     return the stored result.
func (d *Deduper) apply(ctx context.Context, ev *event, rec *record, fn applyFunc) (result []byte, err error) {
	rec.outcome = OutcomeError
	claimStart := time.Now()
	tx, err := d.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		rec.claimWait = time.Since(claimStart)
		return nil, fmt.Errorf("dedupactivity: begin: %w", err)
	}
	committed := false
	defer func() {
		// Roll back on every path that did not commit, panics included.
		if !committed {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_ = tx.Rollback(rctx)
		}
	}()

	claimed, st, err := d.claim(ctx, tx, ev)
	rec.claimWait = time.Since(claimStart)
	if err != nil {
		if errors.Is(err, ErrClaimTimeout) {
			rec.outcome = OutcomeClaimTimeout
		}
		return nil, err
	}
	if !claimed {
		return d.duplicate(ev, rec, st)
	}

	if d.afterClaim != nil {
		if err := d.afterClaim(ctx, tx); err != nil {
			return nil, fmt.Errorf("dedupactivity: after claim: %w", err)
		}
	}

	effectStart := time.Now()
	rec.ranEffect = true
	rec.outcome = OutcomeEffectError // until the effect returns cleanly
	result, err = fn(ctx, tx)
	rec.effectTime = time.Since(effectStart)
	if err != nil {
		var ee effectError
		if !errors.As(err, &ee) {
			rec.outcome = OutcomeError
		}
		return nil, err
	}
	rec.outcome = OutcomeError
	if result != nil {
		if _, err := tx.Exec(ctx, d.q.storeResult, ev.hash[:], result); err != nil {
			return nil, fmt.Errorf("dedupactivity: store result: %w", translate(err))
		}
	}
	if err := tx.Commit(ctx); err != nil {
		// The commit may or may not have reached the server. Either way the
		// retry finds out: it claims the event again, or sees a duplicate.
		return nil, fmt.Errorf("dedupactivity: commit: %w", err)
	}
	committed = true
	rec.outcome = OutcomeClaimed
	return result, nil
}

// claim inserts the marker and reads the marker row, in one round trip.
func (d *Deduper) claim(ctx context.Context, tx pgx.Tx, ev *event) (claimed bool, st stored, err error) {
	var minExpiry *time.Time
	if !ev.minExpiry.IsZero() {
		minExpiry = &ev.minExpiry
	}
	b := &pgx.Batch{}
	b.Queue(`SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", claimWait(ctx, d.opts.ClaimWait).Milliseconds()))
	b.Queue(d.q.insert, ev.hash[:], ev.enc, ev.activityType, ev.fingerprint, fingerprintAlgSHA256JSON,
		ev.attempt, ev.retention.Seconds(), minExpiry)
	b.Queue(`SET LOCAL lock_timeout TO DEFAULT`)
	b.Queue(d.q.selectStored, ev.hash[:])

	br := tx.SendBatch(ctx, b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return false, st, fmt.Errorf("dedupactivity: claim: %w", translate(err))
	}
	err = br.QueryRow().Scan(&claimed)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		claimed = false
	case err != nil:
		return false, st, fmt.Errorf("dedupactivity: claim: %w", translate(err))
	}
	if _, err := br.Exec(); err != nil {
		return false, st, fmt.Errorf("dedupactivity: reset lock_timeout: %w", translate(err))
	}
	if err := br.QueryRow().Scan(&st.fingerprint, &st.alg, &st.result, &st.attempt); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			// Only possible if the marker was pruned between the conflict
			// and the read: let Temporal retry.
			return false, st, errors.New("dedupactivity: marker vanished after conflict, retry")
		}
		return false, st, fmt.Errorf("dedupactivity: read marker: %w", translate(err))
	}
	return claimed, st, br.Close()
}

// duplicate decides what a delivery of an already applied event returns.
func (d *Deduper) duplicate(ev *event, rec *record, st stored) ([]byte, error) {
	rec.storedAttempt = st.attempt
	// Fingerprints made by another algorithm cannot be compared: accept.
	if st.alg == fingerprintAlgSHA256JSON && !bytes.Equal(st.fingerprint, ev.fingerprint) {
		rec.outcome = OutcomePayloadMismatch
		if d.opts.MismatchPolicy == MismatchReject {
			return nil, fmt.Errorf("%w (identity %x, first applied by attempt %d)", ErrPayloadMismatch, ev.hash, st.attempt)
		}
		return st.result, nil
	}
	rec.outcome = OutcomeDuplicate
	return st.result, nil
}

// claimWait is the lock_timeout for the claim: the configured wait, cut short
// by ctx's deadline (less a margin to report the timeout before the
// activity's own deadline), and never below 1ms (0 would mean no limit).
func claimWait(ctx context.Context, wait time.Duration) time.Duration {
	if dl, ok := ctx.Deadline(); ok {
		if rem := time.Until(dl) - 100*time.Millisecond; rem < wait {
			wait = rem
		}
	}
	return max(wait, time.Millisecond)
}
