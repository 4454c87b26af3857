package dedupactivity

// This file holds the claim protocol: one PostgreSQL transaction that claims
// the event identity and, only if the claim is new, applies the effect and
// stores its result. Marker and effect commit or roll back together. The SQL
// itself lives in store.go.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.temporal.io/sdk/activity"
)

// applyFunc runs the user's effect through tx and returns the encoded result
// to store. An error from the effect itself must be wrapped in effectError
// so it is reported as such.
type applyFunc func(ctx context.Context, tx pgx.Tx) ([]byte, error)

// effectError marks an error returned by the user's effect: it is returned to
// Temporal unchanged.
type effectError struct{ err error }

func (e effectError) Error() string { return e.err.Error() }
func (e effectError) Unwrap() error { return e.err }

// attempt is what one delivery did. The claim returns it as a value; the
// wrapper hands it to telemetry.
type attempt struct {
	outcome       Outcome
	claimWait     time.Duration // acquiring a connection and claiming
	effectTime    time.Duration
	ranEffect     bool
	storedAttempt int32  // on a duplicate: the attempt that applied the effect
	result        []byte // the encoded result returned: new, or stored
}

// effectPanic is what an attempt whose effect panicked took (its claim,
// unless a riding claim was never sent, and its effect): claim leaves it
// for the wrapper's telemetry while the panic goes on, not recovered.
type effectPanic struct {
	a       attempt
	claimed bool
	set     bool
}

// claim runs one delivery of the event m on a pooled connection, in one
// READ COMMITTED transaction:
//
//  1. One round trip: BEGIN and the claim statement, which inserts the
//     marker's key (ON CONFLICT DO NOTHING) under the claim wait as its
//     lock_timeout. A concurrent attempt holding the event makes the insert
//     wait, at most the claim wait; a committed marker makes it insert
//     nothing: a duplicate.
//  2. The effect, through a Tx that refuses Commit and Rollback and dies
//     when the attempt ends.
//  3. One round trip: the result into the marker (a HOT update), checked to
//     run in the claim's own transaction, and COMMIT.
//  4. Duplicate: one round trip that rolls back (nothing was written) and
//     reads the committed marker.
//
// When ride is true (see mayRide), step 1 is held back and sent with the
// effect's first statement, as a look for a committed marker instead of the
// insert, and step 3 inserts the whole marker with COMMIT (see claimTx): a
// concurrent attempt that committed the marker first makes that insert
// fail, and this delivery is a duplicate.
//
// A first delivery costs the round trips of the bare effect in a
// transaction, one fewer when the claim rides; a duplicate costs two.
// Nothing in these paths raises an error in PostgreSQL, except the insert
// with COMMIT when a concurrent attempt of a riding delivery won, which
// Temporal does not do on its own (see mayRide), and, once per connection,
// the prepare of an effect's first statement the server refuses (its own
// error, which it then gets from pgx). Any error or panic before
// the commit rolls everything back, the marker included, so the retry
// applies the effect.
//
// When the effect panics, claim sets *panicked before the panic goes on.
func (d *Deduper) claim(ctx context.Context, m *marker, ride bool, fn applyFunc, panicked *effectPanic) (a attempt, err error) {
	a.outcome = OutcomeError
	tx := &claimTx{d: d, m: m, ctx: ctx, start: time.Now()}
	if tx.pc, err = d.pool.Acquire(ctx); err != nil {
		a.claimWait = time.Since(tx.start)
		return a, fmt.Errorf("dedupactivity: acquire connection: %w", err)
	}
	tx.conn = tx.pc.Conn()
	tx.ride = ride && stateOf(tx.conn).named
	defer func() {
		if tx.pc != nil {
			release(ctx, tx.pc)
		}
	}()
	if !tx.ride || d.afterClaim != nil {
		_, _ = tx.send(ctx, nil) // the outcome is in tx.claimErr
	}
	if tx.claimErr != nil {
		return d.claimFailed(ctx, tx, a)
	}
	if d.afterClaim != nil {
		if err := d.afterClaim(ctx, tx); err != nil {
			return a, fmt.Errorf("dedupactivity: after claim: %w", err)
		}
	}

	effectStart := time.Now()
	a.outcome = OutcomeEffectError // until the effect returns cleanly
	returned := false
	defer func() {
		if !returned { // the effect panicked (see effectPanic)
			a.claimWait, a.effectTime, a.ranEffect = tx.took, time.Since(effectStart), true
			*panicked = effectPanic{a: a, claimed: tx.took > 0, set: true}
		}
	}()
	result, err := func() (_ []byte, err error) {
		defer tx.closeOpen() // also on a panic, so the connection can be rolled back and reused
		defer func() {
			// A statement of the effect returned the failed claim's error
			// (a duplicate, a claim timeout) and the effect panicked on it:
			// the claim's outcome stands. Or the effect called a zero
			// LargeObjects, given when none could be made: the attempt
			// fails with the reason.
			if tx.claimErr != nil || tx.loErr != nil {
				if r := recover(); r != nil {
					if tx.claimErr == nil {
						if !panickedInLargeObjects() {
							panic(r) // the effect's own panic
						}
						err = fmt.Errorf("%w (a large-object call panicked on it: %v)", tx.loErr, r)
						return
					}
					err = tx.claimErr
				}
			}
		}()
		// Runs first: waits for a call a goroutine of the effect has in
		// flight, and shuts it out, before anything here reads the claim's
		// state or goes on with the connection.
		defer tx.guard.Close()
		return fn(ctx, tx.guard.Tx(tx))
	}()
	returned = true
	a.effectTime = time.Since(effectStart)
	sentAfter := tx.state == stateNone
	if sentAfter {
		_, _ = tx.send(ctx, nil) // the effect sent no statement
	}
	if err != nil && !errors.Is(tx.claimErr, errDuplicate) && (sentAfter || errors.As(tx.claimErr, new(effectError))) {
		// The effect failed, and the claim either went after it only to
		// find a duplicate (which returns the stored result) or failed
		// through the effect's own first statement, sent or prepared with
		// it (see sendClaim). The effect's error is the attempt's, as for
		// any other failed statement; not the claim's failure (say, on the
		// context the effect ran out of).
		tx.claimErr = nil
	}
	if tx.claimErr != nil {
		// Whatever the effect did went to a transaction that is rolled back.
		return d.claimFailed(ctx, tx, a)
	}
	a.claimWait = tx.took
	a.ranEffect = true
	if err != nil {
		if errors.Is(err, ErrTxOwned) {
			// Not the effect's own failure: a misuse, reported as such.
			a.outcome = OutcomeError
			return a, fmt.Errorf("dedupactivity: effect: %w", errors.Unwrap(err))
		}
		if !errors.As(err, new(effectError)) {
			a.outcome = OutcomeError
		}
		return a, err
	}
	a.outcome = OutcomeError
	switch tx.conn.PgConn().TxStatus() {
	case 'I':
		if tx.state == stateLooked {
			// Not reachable through the Tx: ready refuses the calls that
			// could end the transaction before the marker's key went in.
			// Should it have ended anyway, say so.
			return a, errEndedUnmarked()
		}
		return a, d.endedByEffect(ctx, tx.conn, m)
	case 'E':
		return a, d.failedUnreported(ctx, tx)
	}
	m.result = result
	if tx.state == stateLooked {
		began := time.Now()
		err = d.commitLast(ctx, tx.conn, m)
		if errors.Is(err, errDuplicate) || errors.Is(err, ErrClaimTimeout) {
			a.claimWait += time.Since(began) // it waited for a concurrent attempt
		}
	} else {
		err = d.commit(ctx, tx.conn, m)
	}
	switch {
	case errors.Is(err, errDuplicate):
		return d.duplicate(ctx, tx.conn, m, a)
	case errors.Is(err, ErrClaimTimeout):
		a.outcome = OutcomeClaimTimeout
		return a, err
	case err != nil:
		return a, err
	}
	a.outcome, a.result = OutcomeClaimed, result
	return a, nil
}

// panickedInLargeObjects says whether the panic being recovered (called in
// the deferred function that recovers it, whose caller's frames are still on
// the stack) was raised by a method of pgx's LargeObjects: the zero value
// that claimTx.LargeObjects returns when it cannot make one.
func panickedInLargeObjects() bool {
	pcs := make([]uintptr, 64)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs)])
	for {
		f, more := frames.Next()
		if strings.HasPrefix(f.Function, "github.com/jackc/pgx/v5.(*LargeObjects).") {
			return true
		}
		if !more {
			return false
		}
	}
}

// errEndedUnmarked is the error of an effect that ended the transaction of
// a claim that went as a look, before the marker's key went in.
func errEndedUnmarked() error {
	return fmt.Errorf("%w: it ran ROLLBACK (or COMMIT after a failed statement) before the marker was written: nothing of the transaction committed, and a later delivery applies the effect", ErrTxEnded)
}

// claimFailed finishes a delivery whose claim found the event applied (a
// duplicate) or failed.
func (d *Deduper) claimFailed(ctx context.Context, tx *claimTx, a attempt) (attempt, error) {
	a.claimWait, a.outcome = tx.took, OutcomeError
	if errors.Is(tx.claimErr, errDuplicate) {
		return d.duplicate(ctx, tx.conn, tx.m, a)
	}
	if errors.As(tx.claimErr, new(effectError)) {
		a.outcome = OutcomeEffectError // the statement that rode with the claim failed
		return a, tx.claimErr
	}
	a.outcome = OutcomeError
	if errors.Is(tx.claimErr, ErrClaimTimeout) {
		a.outcome = OutcomeClaimTimeout
	}
	return a, tx.claimErr
}

// sendClaim sends the claim's first round trip on tx's connection: BEGIN
// and the claim statement, or, when q (the effect's first statement) is not
// nil, BEGIN, the look for a committed marker and q. ok says whether the
// event is this attempt's: the claim inserted the marker's key (m.ctid and
// m.xact are set), or the look found no committed marker. When ok and q was
// sent, the returned trip is at q's result and the caller reads and closes
// it. If q cannot be prepared or its arguments encoded, the claim is not
// sent and the error is errNotRidden (a statement the server would not
// prepare was sent to be prepared, once per connection: see
// connState.prepare). A connection that broke before the claim was
// read (a server restart, a backend killed while the connection sat idle in
// the pool), or lost its prepared statements, is replaced or prepared again
// and the round trip sent once more: nothing of it committed.
func (d *Deduper) sendClaim(ctx context.Context, tx *claimTx, q *pgx.QueuedQuery) (t *trip, ok bool, err error) {
	look := q != nil
	if err := ctx.Err(); look && err != nil {
		// The effect's context ran out before its first statement (its
		// own work took the time): nothing is sent, and the error is the
		// effect's, as pgx would return it, not a claim that waited. On a
		// new connection the prepare below would fail on it first, and it
		// read as a claim timeout.
		return nil, false, effectError{fmt.Errorf("dedupactivity: the effect's first statement: %w", err)}
	}
	for try := 1; ; try++ {
		sent := false
		t = newTrip(tx.conn)
		var qsql string
		if look {
			qsql = q.SQL
		}
		err = t.s.prepare(ctx, tx.conn, qsql, d.store.stmts...)
		if err == nil {
			t.add(beginStmt)
			if look {
				d.store.addLook(t, tx.m)
				err = t.addQuery(q.SQL, q.Arguments)
			} else {
				d.store.addClaim(t, tx.m, d.claimWaitFor(ctx, tx.m))
			}
		}
		if errors.Is(err, errNotRidden) {
			if cause := notRiddenCause(err); cause != errNotRidden &&
				(ctx.Err() != nil || errors.Is(cause, context.DeadlineExceeded) || errors.Is(cause, context.Canceled)) {
				// q's prepare (the claim's own were ready) waited, on a
				// lock of q's tables, until the deadline or cancellation:
				// the effect's, as below, not the claim's. The connection
				// may be closed: q cannot be sent after the claim.
				return nil, false, effectError{fmt.Errorf("dedupactivity: the effect's first statement (prepared with the claim): %w", cause)}
			}
			return nil, false, err // nothing was sent
		}
		if err == nil {
			t.send(ctx)
			sent = true
			if _, err = t.exec(); err == nil { // BEGIN
				if look {
					var found bool
					found, err = d.store.looked(t, tx.m)
					ok = !found
				} else {
					ok, err = d.store.claimed(t, tx.m)
				}
			}
		}
		if err == nil {
			if ok && q != nil {
				return t, true, nil
			}
			// Without q, or on a duplicate: q ran in a transaction that is
			// rolled back, and its outcome does not matter.
			if cerr := t.close(); cerr != nil && ok {
				return nil, false, fmt.Errorf("dedupactivity: claim: %w", interpretError(cerr, true))
			}
			return nil, ok, nil
		}
		_ = t.close()
		if look && sent && (ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) {
			// PostgreSQL answers BEGIN and the look only with q, at the
			// round trip's end, and the look waits for nothing (but a lock
			// DDL holds on the marker table): the deadline or cancellation
			// is q's, the effect's own, not a claim that waited. One that
			// came while the claim's statements were being prepared (their
			// Parse waits on such a lock too) is the claim's.
			return nil, false, effectError{fmt.Errorf("dedupactivity: the effect's first statement (sent with the claim): %w", err)}
		}
		if try == 1 && ctx.Err() == nil && (tx.conn.IsClosed() || stale(err)) {
			if err := d.resetConn(ctx, tx); err != nil {
				return nil, false, err
			}
			continue
		}
		return nil, false, claimError(ctx, err)
	}
}

// resetConn makes tx's connection ready to send the claim's first round
// trip again, after it failed before anything of it could commit: a broken
// connection is replaced by a new pooled one; on a live one, whose prepared
// statements were missing (see trip.close), the transaction the round trip
// began is rolled back.
func (d *Deduper) resetConn(ctx context.Context, tx *claimTx) error {
	if !tx.conn.IsClosed() {
		if tx.conn.PgConn().TxStatus() == 'I' {
			return nil
		}
		if _, err := tx.conn.Exec(ctx, "ROLLBACK"); err == nil {
			return nil
		}
	}
	release(ctx, tx.pc)
	tx.pc = nil
	pc, err := d.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("dedupactivity: acquire connection: %w", err)
	}
	tx.pc, tx.conn = pc, pc.Conn()
	return nil
}

// claimKey inserts the marker's key in a transaction that began with a
// look, before a call that might end the transaction; ok is false when the
// marker was committed meanwhile (a duplicate).
func (d *Deduper) claimKey(ctx context.Context, tx *claimTx) (ok bool, err error) {
	t := newTrip(tx.conn)
	d.store.addClaim(t, tx.m, d.claimWaitFor(ctx, tx.m))
	t.send(ctx)
	ok, err = d.store.claimed(t, tx.m)
	if cerr := t.close(); err == nil {
		err = cerr
	}
	if err != nil {
		return false, claimError(ctx, err)
	}
	if !ok {
		// A committed key: in the look's table, or, if the effect changed
		// search_path, in another.
		table, err := d.selfTable(ctx, tx.conn)
		if err != nil {
			return false, claimError(ctx, err)
		}
		if table != tx.m.table {
			return false, fmt.Errorf("%w: the marker's key was found in table OID %d, the look read %d", ErrSearchPathChanged, table, tx.m.table)
		}
	}
	return ok, nil
}

// selfTable is the OID of the table the marker table's name finds now.
func (d *Deduper) selfTable(ctx context.Context, conn *pgx.Conn) (uint32, error) {
	t := newTrip(conn)
	t.add(d.store.self)
	t.send(ctx)
	var table uint32
	_, err := t.row(func(cols [][]byte) (err error) {
		table, err = colUint32(cols[0])
		return err
	})
	if cerr := t.close(); err == nil {
		err = cerr
	}
	return table, err
}

// claimError is the error of a claim statement that failed.
func claimError(ctx context.Context, err error) error {
	switch cancelled := sqlState(err) == stateQueryCanceled && ctx.Err() != nil; {
	case cancelled && !errors.Is(ctx.Err(), context.DeadlineExceeded):
		// The cancel request pgx sends when ctx is done (under
		// CancelRequestContextWatcherHandler), not statement_timeout.
		return fmt.Errorf("dedupactivity: claim: %w: %w", ctx.Err(), err)
	case !cancelled:
		err = interpretError(err, true)
	}
	if _, known := classify(err); !known && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		// The caller's deadline came before the claim wait ran out.
		err = fmt.Errorf("%w (the caller's deadline came first): %w", ErrClaimTimeout, err)
	}
	return fmt.Errorf("dedupactivity: claim: %w", err)
}

// commitLast inserts the whole marker m and commits, in one round trip, for
// a claim that went as a look. It returns errDuplicate when a concurrent
// attempt committed the marker first: nothing of this one commits.
func (d *Deduper) commitLast(ctx context.Context, conn *pgx.Conn, m *marker) error {
	t := newTrip(conn)
	d.store.addInsertLast(t, m, d.claimWaitFor(ctx, m))
	t.add(commitStmt)
	t.send(ctx)
	if _, err := t.exec(); err != nil {
		_ = t.close()
		switch sqlState(err) {
		case stateUniqueViolation:
			return errDuplicate // the insert touches the marker table alone: its key
		case stateLockNotAvailable, stateQueryCanceled:
			return claimError(ctx, err) // the wait for a concurrent attempt
		}
		// The COMMIT behind the insert may or may not have run: the retry
		// finds out.
		return fmt.Errorf("dedupactivity: store marker and commit: %w", interpretError(err, false))
	}
	return d.readCommit(t, true)
}

// release rolls back whatever transaction is still open (error and panic
// paths) and returns the connection to the pool, which destroys it if it is
// broken.
func release(ctx context.Context, conn *pgxpool.Conn) {
	c := conn.Conn()
	if !c.IsClosed() && c.PgConn().TxStatus() != 'I' {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = c.Exec(rctx, "ROLLBACK")
	}
	conn.Release()
}

// commit stores the result in the marker (when results are discarded, only
// checks that the transaction is still the claim's) and commits, in one
// round trip. If the effect ended the claim's transaction and began another,
// the check fails that other transaction, so the COMMIT behind it in the
// round trip commits nothing.
func (d *Deduper) commit(ctx context.Context, conn *pgx.Conn, m *marker) error {
	t := newTrip(conn)
	d.store.addComplete(t, m, !d.opts.DiscardResults)
	t.add(commitStmt)
	t.send(ctx)
	found, err := d.store.completed(t, !d.opts.DiscardResults)
	if err != nil {
		_ = t.close()
		if err = interpretError(err, false); errors.Is(err, ErrTxEnded) {
			return d.endedByEffect(ctx, conn, m)
		}
		return fmt.Errorf("dedupactivity: store result: %w", err)
	}
	return d.readCommit(t, found)
}

// readCommit reads the COMMIT that ends t; found says whether the marker
// was written.
func (d *Deduper) readCommit(t *trip, found bool) error {
	tag, err := t.exec()
	if cerr := t.close(); err == nil {
		err = cerr
	}
	switch {
	case err != nil:
		// The commit may or may not have reached the server. Either way the
		// retry finds out: it claims the event again, or sees a duplicate.
		return fmt.Errorf("dedupactivity: commit: %w", err)
	case tag.String() == "ROLLBACK":
		return fmt.Errorf("dedupactivity: commit: %w", pgx.ErrTxCommitRollback)
	case !found:
		// The effect itself changed or deleted the marker row.
		return fmt.Errorf("%w: the effect changed the marker row; the effect committed without a stored result", ErrTxEnded)
	}
	return nil
}

// endedByEffect reports an effect that ended the claim transaction with SQL
// (COMMIT or ROLLBACK, perhaps followed by BEGIN): it rolls back whatever
// the effect began after that, and says what was committed, read from the
// marker.
func (d *Deduper) endedByEffect(ctx context.Context, conn *pgx.Conn, m *marker) error {
	st, found, err := d.rollBackAndRead(ctx, conn, m)
	switch {
	case err != nil:
		return fmt.Errorf("%w; reading the marker to tell whether it committed failed: %w", ErrTxEnded, err)
	case found && m.insertedBy(st.xmin):
		return errCommittedByEffect()
	case found:
		return fmt.Errorf("%w: it ran ROLLBACK: nothing of this attempt committed, and another attempt has applied the event since", ErrTxEnded)
	default:
		return fmt.Errorf("%w: it ran ROLLBACK: nothing of this attempt committed; a later delivery applies the effect", ErrTxEnded)
	}
}

// failedUnreported is the error of an effect that returned no error while
// its transaction is aborted: a statement of it failed, and the effect
// swallowed the error. That is the claim's transaction, and all of it rolls
// back, unless the effect ran COMMIT (and BEGIN) before the statement: the
// marker's key was in (see ready), so the marker committed with the
// effect's writes before the COMMIT. The marker, read with the rollback
// (which replaces the one release would send), tells the two apart.
func (d *Deduper) failedUnreported(ctx context.Context, tx *claimTx) error {
	const failed = "dedupactivity: a statement of the effect failed but the effect returned no error"
	// Before the marker's key went in only the look was sent, and no call
	// that could end the transaction has run (see ready).
	if tx.state == stateClaimed {
		st, found, err := d.rollBackAndRead(ctx, tx.conn, tx.m)
		if err != nil {
			return fmt.Errorf("%s; reading the marker to tell whether an earlier COMMIT of the effect committed it failed: %w", failed, err)
		}
		if found && tx.m.insertedBy(st.xmin) {
			return errCommittedByEffect()
		}
	}
	return errors.New(failed + "; all was rolled back")
}

// errCommittedByEffect is the error of an effect that ran COMMIT in the
// claim's transaction after the marker's key went in.
func errCommittedByEffect() error {
	return fmt.Errorf("%w: it ran COMMIT: the marker and the effect's writes before the COMMIT committed, without a result, and nothing after it; later deliveries apply nothing (and, unless results are discarded, fail with this error)", ErrTxEnded)
}

// duplicate rolls back the claim transaction (it wrote nothing), reads the
// committed marker and decides what the delivery returns.
func (d *Deduper) duplicate(ctx context.Context, conn *pgx.Conn, m *marker, a attempt) (attempt, error) {
	st, found, err := d.rollBackAndRead(ctx, conn, m)
	return d.judge(m, st, found, err, a)
}

// rollBackAndRead rolls back whatever transaction conn is in and reads m's
// committed marker, in one round trip (ROLLBACK runs in a failed
// transaction too).
func (d *Deduper) rollBackAndRead(ctx context.Context, conn *pgx.Conn, m *marker) (st stored, found bool, err error) {
	t := newTrip(conn)
	inTx := conn.PgConn().TxStatus() != 'I'
	if inTx {
		t.add(rollbackStmt)
	}
	d.store.addRead(t, m)
	t.send(ctx)
	if inTx {
		if _, err = t.exec(); err != nil {
			err = fmt.Errorf("roll back: %w", err)
		}
	}
	if err == nil {
		st, found, err = readStored(t)
	}
	if cerr := t.close(); err == nil {
		err = cerr
	}
	return st, found, err
}

// judge decides what a delivery that found the event's marker committed
// returns, from the marker read (st, found, err).
func (d *Deduper) judge(m *marker, st stored, found bool, err error, a attempt) (attempt, error) {
	if err != nil {
		return a, fmt.Errorf("dedupactivity: read marker: %w", interpretError(err, false))
	}
	if !found {
		// Only possible if the marker was pruned between the claim and the
		// read: let Temporal retry.
		return a, errors.New("dedupactivity: marker vanished after the claim found it, retry")
	}
	a.storedAttempt = st.attempt
	if m.fingerprint == nil && m.activityType != "" && st.activityType != "" && m.activityType != st.activityType {
		// A run-scoped identity (no fingerprint) names one scheduled
		// activity, of one type (the SDK itself fails a local activity
		// whose type changed at its ID as non-determinism): another type's
		// marker is another event that shares its IDs (each of Temporal's
		// test environments has the same workflow, run and first activity
		// IDs; an ActivityID a workflow reused; a local activity a deploy
		// inserted before this one), whatever the mismatch policy, whose
		// stored result is of another type.
		a.outcome = OutcomePayloadMismatch
		return a, fmt.Errorf("%w: the identity's event was applied by activity type %q (%s), this delivery is of %q: two activities share a workflow run and activity ID (in tests, give each its own Table or Schema, as every test environment has the same IDs)", ErrPayloadMismatch, st.activityType, byAttempt(st.attempt), m.activityType)
	}
	if m.fingerprint != nil && st.fingerprint != nil && !bytes.Equal(m.fingerprint, st.fingerprint) {
		a.outcome = OutcomePayloadMismatch
		if d.opts.MismatchPolicy == MismatchReject {
			return a, fmt.Errorf("%w (identity %x, first applied by %s)", ErrPayloadMismatch, m.sum[:], byAttempt(st.attempt))
		}
	} else {
		a.outcome = OutcomeDuplicate
	}
	if st.result == nil {
		a.outcome = OutcomeError
		return a, fmt.Errorf("%w: the event was applied by %s, whose effect ended the claim transaction (or whose caller committed without Claim.Complete), so no result was recorded", ErrTxEnded, byAttempt(st.attempt))
	}
	a.result = st.result
	return a, nil
}

// byAttempt names the delivery that applied an event: its activity attempt,
// or, for Do and ClaimTx outside an activity (attempt 0), none.
func byAttempt(attempt int32) string {
	if attempt < 1 {
		return "a call outside an activity"
	}
	return fmt.Sprintf("attempt %d", attempt)
}

// newMarker validates id and builds the marker a delivery of it claims (the
// input's fingerprint comes later, with fingerprintInput, once the attempt
// is traced).
func (d *Deduper) newMarker(info activity.Info, id Identity, retention time.Duration) (*marker, error) {
	enc := id.Encode()
	if err := id.validate(enc); err != nil {
		return nil, err
	}
	m := &marker{sum: sha256Sum(enc), attempt: info.Attempt, activityType: validText(info.ActivityType.Name),
		expiresAt: expiry(info, retention), heartbeat: info.HeartbeatTimeout}
	if d.opts.DiscardResults {
		m.result = []byte{} // empty, not NULL: a result that is not kept
	}
	return m, nil
}

// fingerprintInput fingerprints a business-keyed input. Run-scoped
// identities need none: Temporal's history fixes their input, so a
// difference could only be a false alarm (an input struct that gained a
// field between attempts). It is generic so that a run-scoped input is not
// boxed into an interface for nothing.
func fingerprintInput[In any](m *marker, id Identity, in In) (err error) {
	if id.Kind == KindBusinessKey {
		m.fingerprint, err = fingerprint(in)
	}
	return err
}

// infoFor is the activity info of ctx (naming id's activity type if it
// names none), or, outside an activity (Do, ClaimTx), identityInfo(id).
func infoFor(ctx context.Context, id Identity) activity.Info {
	if activity.IsActivity(ctx) {
		info := activity.GetInfo(ctx)
		if info.ActivityType.Name == "" {
			info.ActivityType.Name = id.ActivityType
		}
		return info
	}
	return identityInfo(id)
}

// identityInfo is what an activity's info would say about id: its
// namespace, workflow run, activity ID and (for a business key) activity
// type. Outside an activity, results are encoded with the serialization
// context it gives.
func identityInfo(id Identity) activity.Info {
	var info activity.Info
	info.Namespace = id.Namespace
	info.WorkflowExecution.ID, info.WorkflowExecution.RunID = id.WorkflowID, id.RunID
	info.ActivityID, info.ActivityRunID, info.ActivityType.Name = id.ActivityID, id.ActivityRunID, id.ActivityType
	info.IsLocalActivity = id.Kind == KindLocalActivity
	return info
}

// expiry is when a marker claimed now may be pruned: retention from now, and
// never before the activity's own redelivery bound (ScheduledTime +
// ScheduleToClose) when it has one.
func expiry(info activity.Info, retention time.Duration) time.Time {
	at := time.Now().Add(retention)
	if info.ScheduleToCloseTimeout > 0 && !info.ScheduledTime.IsZero() {
		if bound := info.ScheduledTime.Add(info.ScheduleToCloseTimeout); bound.After(at) {
			at = bound
		}
	}
	return at
}

// claimWaitFor is the lock_timeout for m's claim: Options.ClaimWait, cut
// short by ctx's deadline (less a margin to report the timeout before the
// activity's own deadline) and by 80% of the activity's heartbeat timeout
// (the claim sends no heartbeat while it waits; the SDK's own heartbeats
// go out at 80% of it), and never below 1ms (0 would mean no limit).
func (d *Deduper) claimWaitFor(ctx context.Context, m *marker) time.Duration {
	wait := d.opts.ClaimWait
	if m.heartbeat > 0 {
		wait = min(wait, m.heartbeat*4/5)
	}
	if dl, ok := ctx.Deadline(); ok {
		if rem := time.Until(dl) - 100*time.Millisecond; rem < wait {
			wait = rem
		}
	}
	return max(wait, time.Millisecond)
}
