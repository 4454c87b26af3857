package dedupactivity

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// claimTx is the pgx.Tx an effect runs in. The claim owns the transaction:
// Commit and Rollback return ErrTxOwned, and once the attempt ends every
// method returns pgx.ErrTxClosed, so an effect that keeps the Tx cannot write
// outside its event's transaction later (its connection is back in the pool
// by then, possibly inside another event's transaction). Savepoints (Begin)
// work as in pgx.
type claimTx struct {
	conn   *pgx.Conn
	inner  pgx.Tx // pgx's own Tx of the claim transaction (Batch.BeginTx)
	closed atomic.Bool
	depth  int // savepoints opened so far, for their names
}

var _ pgx.Tx = (*claimTx)(nil)

func (t *claimTx) close() { t.closed.Store(true) }

// Begin starts a savepoint, as pgx's Tx.Begin does.
func (t *claimTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
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
	if t.closed.Load() {
		return pgx.ErrTxClosed
	}
	return fmt.Errorf("%w: the effect called Tx.%s", ErrTxOwned, method)
}

// CopyFrom runs COPY FROM in the claim transaction.
func (t *claimTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if t.closed.Load() {
		return 0, pgx.ErrTxClosed
	}
	return t.conn.CopyFrom(ctx, table, cols, src)
}

// SendBatch sends a batch in the claim transaction.
func (t *claimTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.closed.Load() {
		return closedBatch{}
	}
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects returns large-object access in the claim transaction. Do not
// keep it past the effect: unlike the Tx, it is not closed with the attempt.
func (t *claimTx) LargeObjects() pgx.LargeObjects { return t.inner.LargeObjects() }

// Prepare prepares a statement on the claim's connection.
func (t *claimTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Prepare(ctx, name, sql)
}

// Exec runs sql in the claim transaction.
func (t *claimTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.closed.Load() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.conn.Exec(ctx, sql, args...)
}

// Query runs sql in the claim transaction.
func (t *claimTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Query(ctx, sql, args...)
}

// QueryRow runs sql in the claim transaction.
func (t *claimTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.closed.Load() {
		return closedRow{}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

// Conn returns the claim's connection, or nil once the attempt has ended.
// Statements sent on it directly bypass the checks of this Tx.
func (t *claimTx) Conn() *pgx.Conn {
	if t.closed.Load() {
		return nil
	}
	return t.conn
}

// savepoint is a savepoint inside the claim transaction. Its Commit releases
// it and its Rollback rolls back to it, as pgx's nested transactions do; it
// is closed with the claim.
type savepoint struct {
	root   *claimTx
	name   string
	closed bool
}

func (s *savepoint) live() bool { return !s.closed && !s.root.closed.Load() }

func (s *savepoint) Begin(ctx context.Context) (pgx.Tx, error) {
	if !s.live() {
		return nil, pgx.ErrTxClosed
	}
	return s.root.Begin(ctx)
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
		return closedBatch{}
	}
	return s.root.SendBatch(ctx, b)
}

func (s *savepoint) LargeObjects() pgx.LargeObjects { return s.root.LargeObjects() }

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
		return nil, pgx.ErrTxClosed
	}
	return s.root.Query(ctx, sql, args...)
}

func (s *savepoint) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !s.live() {
		return closedRow{}
	}
	return s.root.QueryRow(ctx, sql, args...)
}

func (s *savepoint) Conn() *pgx.Conn { return s.root.Conn() }

// closedRow and closedBatch are what a closed claimTx returns.
type closedRow struct{}

func (closedRow) Scan(...any) error { return pgx.ErrTxClosed }

type closedBatch struct{}

func (closedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, pgx.ErrTxClosed }
func (closedBatch) Query() (pgx.Rows, error)         { return nil, pgx.ErrTxClosed }
func (closedBatch) QueryRow() pgx.Row                { return closedRow{} }
func (closedBatch) Close() error                     { return pgx.ErrTxClosed }
func (closedBatch) Tx() pgx.Tx                       { return nil }
