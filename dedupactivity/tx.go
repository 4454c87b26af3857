package dedupactivity

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/txguard"
)

// claimTx is the pgx.Tx an effect runs in. The claim owns the transaction:
// Commit and Rollback return ErrTxOwned. The effect gets it behind guard
// (see txguard), which the claim closes when the effect returns: a call a
// goroutine of the effect has in flight then is waited for, and every later
// one returns pgx.ErrTxClosed, so an effect that keeps the Tx cannot write
// outside its event's transaction later (its connection is back in the pool
// by then, possibly inside another event's transaction), and the claim's
// own state and connection are its alone from there. Savepoints (Begin)
// work as in pgx.
//
// On a delivery that may ride (see mayRide), the claim's first round trip is
// held back until the effect's first statement and sent with it, as a look
// for a committed marker (stateLooked); the whole marker is then inserted
// with COMMIT. Exec, Query and QueryRow with positional arguments ride; any
// other first call sends the claim on its own first. A statement with bind
// parameters, sent with the extended protocol, cannot end the transaction,
// so while only those have run the marker can wait for COMMIT; any other
// call (Exec without arguments, SendBatch, Begin, Conn, ...) inserts the
// marker's key first. Only a connection that caches statements (pgx's
// default, QueryExecModeCacheStatement) rides: the statement is prepared
// there, as pgx would, and sent with the claim's (see wire.go); on any other
// the claim goes first.
//
// If the look finds the event applied, or fails, the statement that rode
// with it has run in a transaction that is rolled back: the call returns
// errDuplicate (or the claim's error), and so does every later call.
type claimTx struct {
	d     *Deduper
	m     *marker
	ctx   context.Context // the attempt's, for the methods that take none
	pc    *pgxpool.Conn
	conn  *pgx.Conn
	inner pgx.Tx        // a pgx Tx of the claim transaction, made for LargeObjects
	guard txguard.Guard // what the effect gets is this Tx behind it
	depth int           // savepoints opened so far, for their names

	start    time.Time // the attempt's start
	state    claimState
	claimErr error         // errDuplicate, or why the claim failed
	took     time.Duration // from start until the claim was read
	ride     bool          // the claim may ride with the first statement
	riding   *trip         // the round trip the first statement rode in, while unread
	rows     pgx.Rows      // the last Rows of Query, which the effect may leave open
	rideRows *rideRows     // the riding statement's Rows, which the effect may leave open
	loErr    error         // why LargeObjects gave a zero value (see refused)
}

// claimState is how far the claim has gone.
type claimState uint8

const (
	stateNone    claimState = iota // nothing sent yet
	stateLooked                    // BEGIN and the look sent: no marker committed; the marker goes in with COMMIT
	stateClaimed                   // BEGIN and the claim sent: the marker's key is inserted
)

var _ pgx.Tx = (*claimTx)(nil)

// send sends the claim's first round trip: the claim, or, with q, the look
// and q; see Deduper.sendClaim. Its outcome is kept: a duplicate or a failed
// claim is returned by every later call. If q cannot ride (the server will
// not prepare it, its arguments cannot be encoded, or the connection does
// not cache statements), the claim is not sent and send returns
// errNotRidden: the caller sends q through pgx on its own, which reports
// q's own error.
func (t *claimTx) send(ctx context.Context, q *pgx.QueuedQuery) (*trip, error) {
	tr, ok, err := t.d.sendClaim(ctx, t, q)
	if errors.Is(err, errNotRidden) {
		return nil, err
	}
	t.took = time.Since(t.start)
	t.state = stateClaimed
	if q != nil {
		t.state = stateLooked
	}
	switch {
	case err != nil:
		t.claimErr = err
	case !ok:
		t.claimErr = errDuplicate
	}
	t.riding = tr
	return tr, t.claimErr
}

// ready makes the transaction ready for a statement with args (nil for
// calls that are not statements): it sends the claim on its own if nothing
// was sent, and inserts the marker's key after a look unless the statement
// has bind parameters.
func (t *claimTx) ready(ctx context.Context, args []any) error {
	switch {
	case t.claimErr != nil:
		return t.claimErr
	case t.state == stateNone:
		_, err := t.send(ctx, nil)
		return err
	case t.state != stateLooked || positional(args):
		// Statements with bind parameters cannot end a transaction: after a
		// look, the marker can still go in with COMMIT.
	case t.riding != nil || t.conn.PgConn().IsBusy():
		// Rows still open (the first statement's, whose round trip's BEGIN
		// is not acknowledged yet, so the status says nothing, or a later
		// Query's): the connection is busy, as pgx says of any call made
		// then. This call fails alone.
		return errConnBusy
	case t.conn.PgConn().TxStatus() == 'E':
		// A statement failed before the marker's key went in, so the
		// transaction is aborted: all a call without bind parameters could
		// still do is end it (ROLLBACK or COMMIT, AND CHAIN or followed by
		// more statements), and the marker must not then go in with another
		// transaction. Refused, this call only; the attempt rolls back.
		return errAbortedBeforeMarker
	case t.conn.PgConn().TxStatus() == 'I':
		// Not reachable through this Tx (see above). Should the transaction
		// have ended anyway, nothing more may run: it would commit on its
		// own.
		t.claimErr = errEndedUnmarked()
	default:
		t.state = stateClaimed
		began := time.Now()
		ok, err := t.d.claimKey(ctx, t)
		t.took += time.Since(began)
		if err != nil {
			t.claimErr = err
		} else if !ok {
			t.claimErr = errDuplicate
		}
	}
	return t.claimErr
}

// Errors of a single call after a look (see ready). The second is
// retryable, as PostgreSQL's own answer to a statement in an aborted
// transaction (25P02) is, whatever the attempt.
var (
	errConnBusy            = errors.New("dedupactivity: conn busy: read or close the open Rows before a call without bind parameters")
	errAbortedBeforeMarker = errors.New("dedupactivity: current transaction is aborted (a statement failed): a call without bind parameters is refused, as all it could do is end the transaction, which is the claim's to do; return the statement's error")
)

// rides says whether a statement with args can carry the claim: it is the
// first, of a delivery that may ride, and its arguments are positional.
func (t *claimTx) rides(args []any) bool {
	return t.ride && t.state == stateNone && positional(args)
}

// positional says whether args are bind parameters only, so that pgx sends
// the statement with the extended protocol (one statement, parameters
// bound): not none, with which pgx sends the SQL, perhaps several
// statements, as a simple query, and no QueryExecMode, result format or
// QueryRewriter option, which the claim's round trip does not take.
func positional(args []any) bool {
	if len(args) == 0 {
		return false
	}
	switch args[0].(type) {
	case pgx.QueryExecMode, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID, pgx.QueryRewriter:
		return false
	}
	return true
}

// sendRiding sends sql with the claim; the caller reads its result.
func (t *claimTx) sendRiding(ctx context.Context, sql string, args []any) (*trip, error) {
	return t.send(ctx, &pgx.QueuedQuery{SQL: sql, Arguments: args})
}

// closeOpen closes what the effect left open when it ends (its last Rows,
// the round trip its first statement rode in), so the claim can go on on
// the connection.
func (t *claimTx) closeOpen() {
	if t.rows != nil {
		t.rows.Close()
	}
	if t.rideRows != nil {
		// Closed here, so that a Close of Rows the effect kept is a no-op
		// and never reaches the connection another attempt may use by then.
		t.rideRows.Close()
	}
	_ = t.closeRide()
}

// closeRide closes the round trip the first statement rode in, once its
// result has been read.
func (t *claimTx) closeRide() error {
	if t.riding == nil {
		return nil
	}
	tr := t.riding
	t.riding = nil
	return tr.close()
}

// Begin starts a savepoint, as pgx's Tx.Begin does.
func (t *claimTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.ready(ctx, nil); err != nil {
		return nil, err
	}
	t.depth++
	sp := &savepoint{root: t, name: fmt.Sprintf("dedupactivity_sp_%d", t.depth)}
	if _, err := t.conn.Exec(ctx, "SAVEPOINT "+sp.name); err != nil {
		return nil, err
	}
	return sp, nil
}

// Commit refuses: the claim commits the effect together with its marker.
func (t *claimTx) Commit(context.Context) error { return t.refuse("Commit") }

// Rollback refuses: return an error from the effect to roll it back.
func (t *claimTx) Rollback(context.Context) error { return t.refuse("Rollback") }

func (t *claimTx) refuse(method string) error {
	return fmt.Errorf("%w: the effect called Tx.%s", ErrTxOwned, method)
}

// CopyFrom runs COPY FROM in the claim transaction.
func (t *claimTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.ready(ctx, nil); err != nil {
		return 0, err
	}
	return t.conn.CopyFrom(ctx, table, cols, src)
}

// SendBatch sends a batch in the claim transaction. A batch that begins a
// transaction (Batch.BeginTx) is refused with ErrTxOwned, as pgx's Tx
// refuses it: the Tx it gives would end the claim transaction.
func (t *claimTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if beginsTx(b) {
		return pgx.FailedBatchResults(b, t.refuse("SendBatch with a Batch that begins a transaction (Batch.BeginTx)"))
	}
	if err := t.ready(ctx, nil); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return t.conn.SendBatch(ctx, b)
}

// beginsTx says whether b begins a transaction (Batch.BeginTx), which pgx
// keeps unexported: its failed results then carry a Tx.
func beginsTx(b *pgx.Batch) bool { return pgx.FailedBatchResults(b, nil).Tx() != nil }

// LargeObjects returns large-object access in the claim transaction. Do not
// keep it past the effect: unlike the Tx, it is not closed with the attempt.
//
// pgx gives large objects only over a Tx of its own, which it makes by
// sending a statement, so when none can be sent (the claim found the event
// applied or failed, the effect's Rows are open) LargeObjects returns pgx's
// zero LargeObjects, whose calls panic. During the attempt that panic ends
// the effect and the attempt returns the reason (the claim's outcome, or
// the refusal as an error); on a Tx kept past the attempt it is the
// caller's.
func (t *claimTx) LargeObjects() pgx.LargeObjects {
	if err := t.ready(t.ctx, nil); err != nil && !errors.Is(err, errAbortedBeforeMarker) {
		// After a failed statement (errAbortedBeforeMarker) the empty
		// statement below cannot end the transaction, which is aborted:
		// the large-object calls fail there as any statement would.
		t.refused(fmt.Errorf("dedupactivity: Tx.LargeObjects: %w", err))
		return pgx.LargeObjects{}
	}
	if t.inner == nil {
		// An empty statement does nothing, and the server takes it in a
		// failed transaction too.
		inner, err := t.conn.BeginTx(t.ctx, pgx.TxOptions{BeginQuery: ";"})
		if err != nil {
			t.refused(fmt.Errorf("dedupactivity: Tx.LargeObjects: %w", err))
			return pgx.LargeObjects{}
		}
		t.inner = inner
	}
	return t.inner.LargeObjects()
}

// refused keeps why LargeObjects gave a zero value for the panic its calls
// then raise (see claim).
func (t *claimTx) refused(err error) {
	if t.claimErr == nil && t.loErr == nil {
		t.loErr = err
	}
}

// Prepare prepares a statement on the claim's connection.
func (t *claimTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.ready(ctx, nil); err != nil {
		return nil, err
	}
	return t.conn.Prepare(ctx, name, sql)
}

// Exec runs sql in the claim transaction.
func (t *claimTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.rides(args) {
		if tr, err := t.sendRiding(ctx, sql, args); !errors.Is(err, errNotRidden) {
			if err != nil {
				return pgconn.CommandTag{}, err
			}
			tag, err := tr.exec()
			if cerr := t.closeRide(); err == nil {
				err = cerr
			}
			return tag, err
		}
	}
	if err := t.ready(ctx, args); err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.conn.Exec(ctx, sql, args...)
}

// Query runs sql in the claim transaction.
func (t *claimTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.rides(args) {
		if tr, err := t.sendRiding(ctx, sql, args); !errors.Is(err, errNotRidden) {
			if err == nil {
				var rows pgx.Rows
				if rows, err = t.ridingRows(tr); err == nil {
					return rows, nil
				}
			}
			return errRows{err}, err
		}
	}
	if err := t.ready(ctx, args); err != nil {
		return errRows{err}, err
	}
	rows, err := t.conn.Query(ctx, sql, args...)
	t.rows = rows
	return txRows{Rows: rows, tx: t}, err
}

// QueryRow runs sql in the claim transaction.
func (t *claimTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.rides(args) {
		if tr, err := t.sendRiding(ctx, sql, args); !errors.Is(err, errNotRidden) {
			if err == nil {
				var rows pgx.Rows
				if rows, err = t.ridingRows(tr); err == nil {
					return rideRow{rows: rows}
				}
			}
			return errRows{err}
		}
	}
	if err := t.ready(ctx, args); err != nil {
		return errRows{err}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

// Conn returns the claim's connection, or nil (as the guard gives once the
// attempt has ended) when the claim found the event applied or failed, and
// while the effect's Rows are open before the marker's key went in (after
// a first statement that rode with the claim: the connection is busy then,
// as pgx says of any call).
// After a first statement that rode with the claim, Conn claims the event's
// key first, as any later statement would. Statements sent on it directly
// bypass the checks of this Tx.
func (t *claimTx) Conn() *pgx.Conn {
	if err := t.ready(t.ctx, nil); err != nil {
		return nil
	}
	return t.conn
}

// ridingRows reads the result of the statement that rode with the claim
// in tr, as pgx's Rows; closing them closes tr. A statement that failed has
// no result: its error.
func (t *claimTx) ridingRows(tr *trip) (pgx.Rows, error) {
	rr, err := tr.next()
	if err != nil {
		_ = t.closeRide()
		return nil, err
	}
	t.rideRows = &rideRows{Rows: pgx.RowsFromResultReader(t.conn.TypeMap(), rr), tx: t, trip: tr}
	return t.rideRows, nil
}

// rideRows are the Rows of a statement that rode with the claim: once read,
// they close the round trip it came in.
type rideRows struct {
	pgx.Rows
	tx       *claimTx
	trip     *trip
	closeErr error
	done     bool
}

func (r *rideRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.finish()
	return false
}

func (r *rideRows) Close() {
	r.Rows.Close()
	r.finish()
}

func (r *rideRows) finish() {
	if r.done {
		return
	}
	r.done = true
	r.trip.traceQuery(r.Rows.CommandTag(), r.Rows.Err())
	if err := r.tx.closeRide(); err != nil && r.closeErr == nil {
		r.closeErr = err
	}
}

// Conn is the Tx's Conn: a statement sent on it may end the transaction, so
// the marker's key goes in first.
func (r *rideRows) Conn() *pgx.Conn { return r.tx.Conn() }

func (r *rideRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.closeErr
}

// rideRow is the Row of a statement that rode with the claim; Scan is pgx's
// for a Row.
type rideRow struct{ rows pgx.Rows }

func (r rideRow) Scan(dest ...any) error {
	rows := r.rows
	defer rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, d := range dest {
		if _, ok := d.(*pgtype.DriverBytes); ok {
			return errors.New("cannot scan into *pgtype.DriverBytes from QueryRow")
		}
	}
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	_ = rows.Scan(dest...)
	rows.Close()
	return rows.Err()
}

// txRows are the Rows of a Query sent directly; see rideRows.Conn.
type txRows struct {
	pgx.Rows
	tx *claimTx
}

func (r txRows) Conn() *pgx.Conn { return r.tx.Conn() }

// savepoint is a savepoint inside the claim transaction. Its Commit releases
// it and its Rollback rolls back to it, as pgx's nested transactions do; it
// is closed with its parent, which PostgreSQL destroys it with, and with the
// claim (by the guard, as the claim's Tx is).
type savepoint struct {
	root   *claimTx
	parent *savepoint // nil for one the claim's Tx began
	name   string
	closed bool
}

func (s *savepoint) live() bool {
	for sp := s; sp != nil; sp = sp.parent {
		if sp.closed {
			return false
		}
	}
	return true
}

func (s *savepoint) Begin(ctx context.Context) (pgx.Tx, error) {
	if !s.live() {
		return nil, pgx.ErrTxClosed
	}
	tx, err := s.root.Begin(ctx)
	if err != nil {
		return nil, err
	}
	sp := tx.(*savepoint)
	sp.parent = s
	return sp, nil
}

func (s *savepoint) Commit(ctx context.Context) error { return s.end(ctx, "RELEASE SAVEPOINT ") }

func (s *savepoint) Rollback(ctx context.Context) error { return s.end(ctx, "ROLLBACK TO SAVEPOINT ") }

func (s *savepoint) end(ctx context.Context, sql string) error {
	if !s.live() {
		return pgx.ErrTxClosed
	}
	s.closed = true
	_, err := s.root.conn.Exec(ctx, sql+s.name)
	return err
}

func (s *savepoint) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if !s.live() {
		return 0, pgx.ErrTxClosed
	}
	return s.root.CopyFrom(ctx, table, cols, src)
}

func (s *savepoint) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if !s.live() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return s.root.SendBatch(ctx, b)
}

// LargeObjects of a savepoint released or rolled back are pgx's zero
// LargeObjects, whose calls panic, as the claim's own once it cannot give
// them (see claimTx.LargeObjects): the claim's would write outside the
// savepoint.
func (s *savepoint) LargeObjects() pgx.LargeObjects {
	if !s.live() {
		s.root.refused(fmt.Errorf("dedupactivity: Tx.LargeObjects: savepoint %w", pgx.ErrTxClosed))
		return pgx.LargeObjects{}
	}
	return s.root.LargeObjects()
}

func (s *savepoint) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if !s.live() {
		return nil, pgx.ErrTxClosed
	}
	return s.root.Prepare(ctx, name, sql)
}

func (s *savepoint) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if !s.live() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return s.root.Exec(ctx, sql, args...)
}

func (s *savepoint) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if !s.live() {
		return errRows{pgx.ErrTxClosed}, pgx.ErrTxClosed
	}
	return s.root.Query(ctx, sql, args...)
}

func (s *savepoint) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !s.live() {
		return errRows{pgx.ErrTxClosed}
	}
	return s.root.QueryRow(ctx, sql, args...)
}

func (s *savepoint) Conn() *pgx.Conn { return s.root.Conn() }

// errRows are what a claimTx that cannot take statements returns: its Rows
// and Row fail with the reason (its BatchResults are pgx.FailedBatchResults).
type errRows struct{ err error }

func (r errRows) Close()                                       {}
func (r errRows) Err() error                                   { return r.err }
func (r errRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (r errRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (r errRows) Next() bool                                   { return false }
func (r errRows) Scan(...any) error                            { return r.err }
func (r errRows) Values() ([]any, error)                       { return nil, r.err }
func (r errRows) RawValues() [][]byte                          { return nil }
func (r errRows) Conn() *pgx.Conn                              { return nil }
func (r errRows) TypeMap() *pgtype.Map                         { return nil }
