// Package txguard stands between code that may outlive its transaction and
// the pgx.Tx it was given: each call on the Tx (and on its Rows, Row and
// BatchResults) holds a mutex, and Close waits for the call in flight and
// shuts out every later one with pgx.ErrTxClosed.
//
// An effect, or an HTTP handler, can go on after it returns in a goroutine
// of its own (one it started, or the one an http.TimeoutHandler leaves
// running), while the code that gave it the Tx ends the transaction and
// puts the connection back in the pool. Without a guard, a call that passed
// a closed check just before the end would reach that connection: racing
// with the COMMIT, or landing in another transaction of its next user.
//
// A call takes the mutex with TryLock, not Lock: a second call while one is
// in flight fails with "conn busy", as pgx answers a busy connection, where
// waiting would deadlock a callback of the first (a Batch's, a
// CopyFromSource's) that calls the Tx.
package txguard

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// errBusy is a call on a guarded Tx made while another one of its calls is
// in flight (from another goroutine, or from a callback of that call), as
// pgx refuses a second call on a busy connection.
var errBusy = errors.New("dedupactivity: conn busy: another call on the Tx is in flight")

// Guard guards the Txs its Tx method gives. The zero value is ready to use;
// a Guard must not be copied after first use.
type Guard struct {
	mu     sync.Mutex
	closed atomic.Bool
	conn   atomic.Pointer[pgx.Conn] // the connection a Tx gave, for Conn while a call is in flight
}

// enter takes the guard for one call; leave gives it back.
func (g *Guard) enter() error {
	if g.closed.Load() {
		return pgx.ErrTxClosed
	}
	if !g.mu.TryLock() {
		if g.closed.Load() {
			return pgx.ErrTxClosed
		}
		return errBusy
	}
	if g.closed.Load() {
		g.mu.Unlock()
		return pgx.ErrTxClosed
	}
	return nil
}

func (g *Guard) leave() { g.mu.Unlock() }

// Close refuses every later call and waits for the call in flight, if any.
// It may be called more than once. The flag goes first: a running
// goroutine's TryLock can take the mutex ahead of a waiting Lock, and enter
// checks the flag again once it has it.
func (g *Guard) Close() {
	g.closed.Store(true)
	g.mu.Lock()
	//lint:ignore SA2001 the empty critical section waits for the call in flight
	g.mu.Unlock()
}

// given keeps c, a connection the guarded Tx gave, for a Conn while
// another call is in flight (see guardedTx.Conn).
func (g *Guard) given(c *pgx.Conn) *pgx.Conn {
	if c != nil {
		g.conn.Store(c)
	}
	return c
}

// Tx returns tx behind g; its savepoints (Begin) are behind g too. tx must
// refuse a batch that begins a transaction (Batch.BeginTx), as pgx's Txs
// and the claim's do, so that the Tx of such a batch is a closed one. What
// LargeObjects and Conn give (tx's, or, while another call is in flight,
// see those methods) the guard cannot stand in front of: use it only until
// Close.
func (g *Guard) Tx(tx pgx.Tx) pgx.Tx { return guardedTx{g: g, tx: tx} }

// guardedTx is a Tx behind a guard.
type guardedTx struct {
	g  *Guard
	tx pgx.Tx
}

var _ pgx.Tx = guardedTx{}

func (t guardedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.g.enter(); err != nil {
		return nil, err
	}
	defer t.g.leave()
	sp, err := t.tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return guardedTx{g: t.g, tx: sp}, nil
}

func (t guardedTx) Commit(ctx context.Context) error {
	if err := t.g.enter(); err != nil {
		return err
	}
	defer t.g.leave()
	return t.tx.Commit(ctx)
}

func (t guardedTx) Rollback(ctx context.Context) error {
	if err := t.g.enter(); err != nil {
		return err
	}
	defer t.g.leave()
	return t.tx.Rollback(ctx)
}

func (t guardedTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.g.enter(); err != nil {
		return 0, err
	}
	defer t.g.leave()
	return t.tx.CopyFrom(ctx, table, cols, src)
}

// SendBatch keeps the Tx's connection once the batch is sent, for a Conn
// in a callback, which pgx runs in the BatchResults' calls: the Tx is
// ready for statements by then, so asking sends nothing. A batch that
// begins a transaction is not sent on the Tx (pgx refuses it there), so
// nothing is asked of the Tx for it.
func (t guardedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := t.g.enter(); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	defer t.g.leave()
	br := t.tx.SendBatch(ctx, b)
	if br.Tx() == nil {
		t.g.given(t.tx.Conn())
	}
	return guardedBatch{g: t.g, br: br}
}

// LargeObjects gives the Tx's. While another call is in flight it cannot
// be asked (the claim's Tx may send a statement to make them): the large
// objects of a closed Tx then, whose calls return pgx.ErrTxClosed (pgx
// makes no other kind). Once the guard is closed, pgx's zero LargeObjects,
// whose calls panic, as the claim's Tx gives once the attempt has ended.
func (t guardedTx) LargeObjects() pgx.LargeObjects {
	switch err := t.g.enter(); {
	case err == nil:
		defer t.g.leave()
		return t.tx.LargeObjects()
	case errors.Is(err, errBusy):
		b := &pgx.Batch{}
		b.BeginTx(pgx.TxOptions{})
		return pgx.FailedBatchResults(b, nil).Tx().LargeObjects()
	default:
		return pgx.LargeObjects{}
	}
}

func (t guardedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.g.enter(); err != nil {
		return nil, err
	}
	defer t.g.leave()
	return t.tx.Prepare(ctx, name, sql)
}

func (t guardedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := t.g.enter(); err != nil {
		return pgconn.CommandTag{}, err
	}
	defer t.g.leave()
	return t.tx.Exec(ctx, sql, args...)
}

func (t guardedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.g.enter(); err != nil {
		return &guardedRows{err: err}, err
	}
	defer t.g.leave()
	rows, err := t.tx.Query(ctx, sql, args...)
	return &guardedRows{g: t.g, rows: rows}, err
}

func (t guardedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := t.g.enter(); err != nil {
		return guardedRow{err: err}
	}
	defer t.g.leave()
	return guardedRow{g: t.g, row: t.tx.QueryRow(ctx, sql, args...)}
}

// Conn gives the Tx's connection. While another call is in flight the Tx
// cannot be asked (the claim's Tx may send a statement first), so Conn
// gives the connection a call gave before, if any (inside a Batch's
// callback, the one its SendBatch kept), else nil; once the guard is
// closed, nil.
func (t guardedTx) Conn() *pgx.Conn {
	switch err := t.g.enter(); {
	case err == nil:
		defer t.g.leave()
		return t.g.given(t.tx.Conn())
	case errors.Is(err, errBusy):
		return t.g.conn.Load()
	default:
		return nil
	}
}

// guardedRows are the Rows of a guardedTx's Query. A call the guard refuses
// reads as on closed Rows: Next is false, and Err and Scan return the
// refusal. Its err is the guard's refusal of the Query; cut a Next's: a
// Next that returns false ends the rows for its caller, who then reads
// Err, which must not say nil for rows cut short. Close still closes them
// once it can (cut is set without the guard, hence atomic).
type guardedRows struct {
	g    *Guard
	rows pgx.Rows
	err  error
	cut  atomic.Pointer[error]
}

func (r *guardedRows) enter() error {
	if r.err != nil {
		return r.err
	}
	if err := r.cut.Load(); err != nil {
		return *err
	}
	return r.g.enter()
}

func (r *guardedRows) Close() {
	if r.err != nil || r.g.enter() != nil {
		return
	}
	defer r.g.leave()
	r.rows.Close()
}

func (r *guardedRows) Err() error {
	if err := r.enter(); err != nil {
		return err
	}
	defer r.g.leave()
	return r.rows.Err()
}

func (r *guardedRows) CommandTag() pgconn.CommandTag {
	if r.enter() != nil {
		return pgconn.CommandTag{}
	}
	defer r.g.leave()
	return r.rows.CommandTag()
}

func (r *guardedRows) FieldDescriptions() []pgconn.FieldDescription {
	if r.enter() != nil {
		return nil
	}
	defer r.g.leave()
	return r.rows.FieldDescriptions()
}

func (r *guardedRows) Next() bool {
	if err := r.enter(); err != nil {
		r.cut.CompareAndSwap(nil, &err)
		return false
	}
	defer r.g.leave()
	return r.rows.Next()
}

func (r *guardedRows) Scan(dest ...any) error {
	if err := r.enter(); err != nil {
		return err
	}
	defer r.g.leave()
	return r.rows.Scan(dest...)
}

func (r *guardedRows) Values() ([]any, error) {
	if err := r.enter(); err != nil {
		return nil, err
	}
	defer r.g.leave()
	return r.rows.Values()
}

func (r *guardedRows) RawValues() [][]byte {
	if r.enter() != nil {
		return nil
	}
	defer r.g.leave()
	return r.rows.RawValues()
}

func (r *guardedRows) Conn() *pgx.Conn {
	if r.enter() != nil {
		return nil
	}
	defer r.g.leave()
	return r.rows.Conn()
}

func (r *guardedRows) TypeMap() *pgtype.Map {
	if r.enter() != nil {
		return nil
	}
	defer r.g.leave()
	return r.rows.TypeMap()
}

// guardedRow is the Row of a guardedTx's QueryRow: pgx reads its result in
// Scan. Its err is the guard's refusal of the QueryRow.
type guardedRow struct {
	g   *Guard
	row pgx.Row
	err error
}

func (r guardedRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	if err := r.g.enter(); err != nil {
		return err
	}
	defer r.g.leave()
	return r.row.Scan(dest...)
}

// guardedBatch are the BatchResults of a guardedTx's SendBatch: pgx reads
// them, and runs the queued queries' callbacks, in these calls.
type guardedBatch struct {
	g  *Guard
	br pgx.BatchResults
}

func (b guardedBatch) Exec() (pgconn.CommandTag, error) {
	if err := b.g.enter(); err != nil {
		return pgconn.CommandTag{}, err
	}
	defer b.g.leave()
	return b.br.Exec()
}

func (b guardedBatch) Query() (pgx.Rows, error) {
	if err := b.g.enter(); err != nil {
		return &guardedRows{err: err}, err
	}
	defer b.g.leave()
	rows, err := b.br.Query()
	return &guardedRows{g: b.g, rows: rows}, err
}

func (b guardedBatch) QueryRow() pgx.Row {
	if err := b.g.enter(); err != nil {
		return guardedRow{err: err}
	}
	defer b.g.leave()
	return guardedRow{g: b.g, row: b.br.QueryRow()}
}

func (b guardedBatch) Close() error {
	if err := b.g.enter(); err != nil {
		return err
	}
	defer b.g.leave()
	return b.br.Close()
}

// Tx is the BatchResults' own: nil, or, for a batch that begins a
// transaction, which the guarded Tx refused (see Guard.Tx), a closed Tx,
// which reaches no connection. pgx keeps it from SendBatch on, so reading it
// needs no call (and, as in pgx, works inside a callback).
func (b guardedBatch) Tx() pgx.Tx { return b.br.Tx() }
