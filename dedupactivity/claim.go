package dedupactivity

// This file holds the claim logic: one PostgreSQL transaction that claims
// the event identity and, only if the claim is new, applies the effect and
// stores its result. Marker and effect commit or roll back together.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
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
	scheduledAt  time.Time // the partition key in the partitioned layout
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
// The steps, on one pooled connection, in one READ COMMITTED transaction:
//
//  1. One round trip (a simple query sent as the transaction's BEGIN):
//     BEGIN, and the lock function (migration 003), which takes a
//     transaction-scoped advisory lock on the event, waiting at most the
//     claim wait for a concurrent attempt of the same event to end, and
//     then looks for the event's marker with a fresh snapshot: if one is
//     committed, it raises SQLSTATE DDUP1 and this is a duplicate.
//  2. Run the effect through the same pgx.Tx.
//  3. One round trip that inserts the marker with the effect's result
//     (INSERT ... ON CONFLICT DO NOTHING RETURNING, under the primary key)
//     and COMMITs. The insert fails unless it inserted a row, so the COMMIT
//     pipelined behind it commits the effect only together with its marker.
//     Any error or panic before this rolls everything back, so the event
//     stays available for the retry.
//  4. Duplicate: one round trip that rolls back (nothing was written) and
//     reads the stored marker; compare fingerprints; return the stored
//     result. A conflict in step 3 (a marker committed by an attempt that
//     did not take the lock, such as a worker of an earlier version of this
//     package) takes the same path after its effect was rolled back.
//
// Inserting the marker when the result is known, not before the effect,
// writes one row version per event instead of two (an insert, then an
// update of the result): less WAL and no dead versions, and no UPDATE
// privilege needed to claim. In side-by-side runs its throughput was 0.93x
// to 1.10x the former order's (docs/bench.md, the "by hand" rows). A first
// delivery costs the same round trips as the bare effect in a transaction
// (BEGIN ... COMMIT), and a duplicate costs two.
func (d *Deduper) apply(ctx context.Context, ev *event, rec *record, fn applyFunc) (result []byte, err error) {
	rec.outcome = OutcomeError
	claimStart := time.Now()
	conn, err := d.pool.Acquire(ctx)
	if err != nil {
		rec.claimWait = time.Since(claimStart)
		return nil, fmt.Errorf("dedupactivity: acquire connection: %w", err)
	}
	defer conn.Release() // destroys the connection if it is not idle
	defer func() {
		// Roll back on every path that left a transaction open, panics
		// included.
		c := conn.Conn()
		if !c.IsClosed() && c.PgConn().TxStatus() != 'I' {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_, _ = c.Exec(rctx, "ROLLBACK")
		}
	}()

	tx, err := conn.Conn().BeginTx(ctx, pgx.TxOptions{BeginQuery: d.lockSQL(ctx, ev)})
	rec.claimWait = time.Since(claimStart)
	if err != nil {
		if sqlState(err) == duplicateState {
			return d.readDuplicate(ctx, conn.Conn(), ev, rec)
		}
		err = translate(err)
		if errors.Is(err, ErrClaimTimeout) {
			rec.outcome = OutcomeClaimTimeout
		}
		return nil, fmt.Errorf("dedupactivity: claim: %w", err)
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
	if err := d.commit(ctx, conn.Conn(), ev, result); err != nil {
		if errors.Is(err, errMarkerExists) {
			return d.readDuplicate(ctx, conn.Conn(), ev, rec)
		}
		return nil, err
	}
	rec.outcome = OutcomeClaimed
	return result, nil
}

// duplicateState is the SQLSTATE the lock function raises for an event
// already applied (migration 003).
const duplicateState = "DDUP1"

// errMarkerExists: the marker insert found the event's marker already
// committed; the transaction did not commit.
var errMarkerExists = errors.New("dedupactivity: marker already committed")

// lockSQL is the claim, sent as the transaction's BEGIN query: BEGIN and a
// call of the lock function (migration 003) in one simple-protocol round
// trip. The simple protocol takes no parameters, so every value is a
// literal built only from hex digits, numbers and a timestamp: nothing in an
// identity or input reaches the SQL text.
func (d *Deduper) lockSQL(ctx context.Context, ev *event) string {
	partitionKey := ""
	if d.opts.PartitionInterval > 0 {
		partitionKey = timeLiteral(ev.scheduledAt) + ", "
	}
	return fmt.Sprintf("BEGIN ISOLATION LEVEL READ COMMITTED; SELECT %s(%s, %s%d, '%dms')",
		d.lockFunc, hexLiteral(ev.hash[:]), partitionKey, d.eventLockKey(ev),
		claimWait(ctx, d.opts.ClaimWait).Milliseconds())
}

// eventLockKey is the advisory lock key of ev: 64 bits of its hash, mixed
// with the table's own so that Dedupers on different tables do not wait for
// each other. Two events sharing a key (or an application's advisory lock
// sharing it) only wait for each other; they never decide each other's
// outcome, since the marker lookup and the primary key do.
func (d *Deduper) eventLockKey(ev *event) int64 {
	return int64(binary.BigEndian.Uint64(ev.hash[:8]) ^ d.lockSalt)
}

// readDuplicate rolls back, reads the stored marker of ev and decides what
// the duplicate delivery returns.
func (d *Deduper) readDuplicate(ctx context.Context, conn *pgx.Conn, ev *event, rec *record) ([]byte, error) {
	st, err := d.readStored(ctx, conn, ev)
	if err != nil {
		return nil, err
	}
	return d.duplicate(ev, rec, st)
}

// readStored rolls back the failed claim and reads the stored marker, in one
// round trip: a simple-protocol query, since the aborted transaction refuses
// the prepare step the extended protocol would send first.
func (d *Deduper) readStored(ctx context.Context, conn *pgx.Conn, ev *event) (stored, error) {
	var st stored
	sql := "ROLLBACK; " + d.q.selectStoredLiteral + hexLiteral(ev.hash[:])
	if d.opts.PartitionInterval > 0 {
		sql += " AND scheduled_at = " + timeLiteral(ev.scheduledAt)
	}
	results, err := conn.PgConn().Exec(ctx, sql).ReadAll()
	if err != nil {
		return st, fmt.Errorf("dedupactivity: read marker: %w", translate(err))
	}
	if len(results) != 2 || len(results[1].Rows) != 1 || len(results[1].Rows[0]) != 4 {
		// Only possible if the marker was pruned between the conflict and
		// the read: let Temporal retry.
		return st, errors.New("dedupactivity: marker vanished after conflict, retry")
	}
	row := results[1].Rows[0] // text format
	if st.fingerprint, err = decodeByteaText(row[0]); err != nil {
		return st, err
	}
	alg, err := strconv.ParseInt(string(row[1]), 10, 16)
	if err != nil {
		return st, fmt.Errorf("dedupactivity: read marker: fingerprint_alg: %w", err)
	}
	st.alg = int16(alg)
	if row[2] != nil {
		if st.result, err = decodeByteaText(row[2]); err != nil {
			return st, err
		}
	}
	attempt, err := strconv.ParseInt(string(row[3]), 10, 32)
	if err != nil {
		return st, fmt.Errorf("dedupactivity: read marker: attempt: %w", err)
	}
	st.attempt = int32(attempt)
	return st, nil
}

// decodeByteaText decodes PostgreSQL's hex text format for bytea (\x...).
func decodeByteaText(b []byte) ([]byte, error) {
	if len(b) < 2 || b[0] != '\\' || b[1] != 'x' {
		return nil, fmt.Errorf("dedupactivity: read marker: unexpected bytea text %.20q", b)
	}
	out := make([]byte, hex.DecodedLen(len(b)-2))
	if _, err := hex.Decode(out, b[2:]); err != nil {
		return nil, fmt.Errorf("dedupactivity: read marker: %w", err)
	}
	return out, nil
}

// commit inserts the marker with the result (NULL when there is none) and
// commits, in one round trip.
func (d *Deduper) commit(ctx context.Context, conn *pgx.Conn, ev *event, result []byte) error {
	var minExpiry any // NULL: no bound of the activity's own
	if !ev.minExpiry.IsZero() {
		minExpiry = ev.minExpiry
	}
	args := []any{ev.hash[:], ev.enc, validText(ev.activityType), ev.fingerprint, fingerprintAlgSHA256JSON,
		ev.attempt, result, ev.retention.Seconds(), minExpiry}
	if d.opts.PartitionInterval > 0 {
		args = append(args, ev.scheduledAt)
	}
	b := &pgx.Batch{}
	b.Queue(d.q.insertMarker, args...)
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	defer br.Close()
	// The insert fails (division by zero) unless it inserted the marker, so
	// the COMMIT behind it in the pipeline never commits an effect without
	// its marker: the server skips it and the transaction stays aborted.
	if _, err := br.Exec(); err != nil {
		if sqlState(err) == "22012" {
			return errMarkerExists
		}
		return fmt.Errorf("dedupactivity: insert marker: %w", translate(err))
	}
	tag, err := br.Exec()
	if err != nil {
		// The commit may or may not have reached the server. Either way the
		// retry finds out: it claims the event again, or sees a duplicate.
		return fmt.Errorf("dedupactivity: commit: %w", err)
	}
	if tag.String() == "ROLLBACK" {
		// An effect statement failed but the effect returned no error.
		return fmt.Errorf("dedupactivity: commit: %w", pgx.ErrTxCommitRollback)
	}
	return br.Close()
}

// timeLiteral is a timestamptz literal; RFC 3339 text holds only digits and
// "-:.TZ". PostgreSQL keeps microseconds and rounds longer literals, while
// pgx truncates time parameters: truncating here makes a literal and a
// parameter for the same time name the same value (the partition key is
// written both ways).
func timeLiteral(t time.Time) string {
	return "'" + t.UTC().Truncate(time.Microsecond).Format(time.RFC3339Nano) + "'::timestamptz"
}

// hexLiteral is a bytea literal in hex format. It is an escape string
// (E'\\x...'), so it means the same whatever standard_conforming_strings
// says; and a literal, not a decode() call, which the server would parse and
// evaluate on every claim.
func hexLiteral(b []byte) string {
	out := make([]byte, 0, len(`E'\\x'::bytea`)+2*len(b))
	out = append(out, `E'\\x`...)
	out = hex.AppendEncode(out, b)
	return string(append(out, `'::bytea`...))
}

// validText makes s storable as text: bytes that are not valid UTF-8, and
// NUL, which text cannot hold, become U+FFFD.
func validText(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

func sqlState(err error) string {
	var pgErr interface{ SQLState() string }
	if errors.As(err, &pgErr) {
		return pgErr.SQLState()
	}
	return ""
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
