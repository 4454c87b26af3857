package txguard_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/txguard"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

// The guard's contract, on real transactions of a test server. The core
// library's TestTx* tests and idemhttp's TestTimeoutHandlerInside test it
// where it is used.

func TestMain(m *testing.M) { pgtest.Main(m) }

// begin returns a transaction in a fresh schema with a table t, and a
// count of t's rows read on another connection.
func begin(t *testing.T) (pgx.Tx, func() int64) {
	t.Helper()
	s := pgtest.NewSchema(t)
	_, err := s.Pool.Exec(context.Background(), `CREATE TABLE t (n int)`)
	require.NoError(t, err)
	return beginIn(t, s)
}

// beginIn returns a transaction of its own connection in s, which the
// test's cleanup rolls back, and a count of t's rows.
func beginIn(t *testing.T, s *pgtest.Schema) (pgx.Tx, func() int64) {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx, func() int64 {
		var n int64
		require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM t`).Scan(&n))
		return n
	}
}

// inFlight runs sql on tx in a goroutine and returns once its backend is
// running it (pg_stat_activity, read on another connection), with the
// channel that gets the call's error.
func inFlight(t *testing.T, tx pgx.Tx, sql string) <-chan error {
	t.Helper()
	var pid uint32
	require.NoError(t, tx.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&pid))
	done := make(chan error, 1)
	go func() {
		_, err := tx.Exec(context.Background(), sql)
		done <- err
	}()
	other, err := pgx.Connect(context.Background(), pgtest.RequireServer(t).URL)
	require.NoError(t, err)
	defer other.Close(context.Background())
	require.Eventually(t, func() bool {
		var active bool
		err := other.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1 AND state = 'active')`, pid).Scan(&active)
		return err == nil && active
	}, 5*time.Second, 5*time.Millisecond, "the call reached the server")
	return done
}

func requireBusy(t *testing.T, err error, msg ...any) {
	t.Helper()
	require.Error(t, err, msg...)
	require.Contains(t, err.Error(), "conn busy", msg...)
}

// TestCloseWaitsForTheCallInFlight: Close returns once the call in flight
// has returned, that call's work stays in the transaction, every later
// call is pgx.ErrTxClosed, and the transaction itself is not ended.
func TestCloseWaitsForTheCallInFlight(t *testing.T) {
	tx, rows := begin(t)
	var g txguard.Guard
	gtx := g.Tx(tx)
	done := inFlight(t, gtx, `INSERT INTO t SELECT 1 FROM pg_sleep(0.3)`)

	g.Close()
	// The connection is free: the call has returned from pgx (its own
	// goroutine may not have sent its result yet).
	var n int
	require.NoError(t, tx.QueryRow(context.Background(), `SELECT count(*) FROM t`).Scan(&n), "Close returned while the call was in flight")
	require.Equal(t, 1, n)
	require.NoError(t, <-done)
	g.Close() // more than once

	_, err := gtx.Exec(context.Background(), `INSERT INTO t VALUES (2)`)
	require.ErrorIs(t, err, pgx.ErrTxClosed)
	require.ErrorIs(t, gtx.Commit(context.Background()), pgx.ErrTxClosed)
	require.ErrorIs(t, gtx.Rollback(context.Background()), pgx.ErrTxClosed)
	require.Nil(t, gtx.Conn())

	require.NoError(t, tx.Commit(context.Background()), "the owner ends the transaction")
	require.Equal(t, int64(1), rows(), "the call in flight's row, not the refused one")
}

// TestCallWhileAnotherIsInFlight: a second call is refused as busy, as pgx
// refuses a busy connection, and reaches nothing; Conn gives the connection
// an earlier call gave, without asking the Tx.
func TestCallWhileAnotherIsInFlight(t *testing.T) {
	tx, rows := begin(t)
	var g txguard.Guard
	gtx := g.Tx(tx)
	conn := gtx.Conn()
	require.NotNil(t, conn)
	done := inFlight(t, gtx, `SELECT pg_sleep(0.3)`)

	ctx := context.Background()
	_, err := gtx.Exec(ctx, `INSERT INTO t VALUES (1)`)
	requireBusy(t, err)
	_, err = gtx.Query(ctx, `SELECT 1`)
	requireBusy(t, err)
	requireBusy(t, gtx.QueryRow(ctx, `SELECT 1`).Scan(new(int)))
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO t VALUES (2)`)
	br := gtx.SendBatch(ctx, b)
	_, err = br.Exec()
	requireBusy(t, err)
	requireBusy(t, br.Close())
	_, err = gtx.Begin(ctx)
	requireBusy(t, err)
	_, err = gtx.Prepare(ctx, "s", `SELECT 1`)
	requireBusy(t, err)
	_, err = gtx.CopyFrom(ctx, pgx.Identifier{"t"}, []string{"n"}, pgx.CopyFromRows([][]any{{3}}))
	requireBusy(t, err)
	require.Same(t, conn, gtx.Conn())
	lo := gtx.LargeObjects()
	_, err = lo.Create(ctx, 0)
	require.ErrorIs(t, err, pgx.ErrTxClosed, "large objects while busy reach no connection")

	require.NoError(t, <-done)
	_, err = gtx.Exec(ctx, `INSERT INTO t VALUES (4)`)
	require.NoError(t, err, "the Tx takes calls again")
	g.Close()
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, int64(1), rows(), "only the call made once the first returned")
}

// TestConnWhileBusyBeforeAnyCall: with no connection given before (only
// Conn and SendBatch give one), Conn while a call is in flight is nil.
func TestConnWhileBusyBeforeAnyCall(t *testing.T) {
	tx, _ := begin(t)
	var g txguard.Guard
	gtx := g.Tx(tx)
	done := inFlight(t, gtx, `SELECT pg_sleep(0.2)`)
	require.Nil(t, gtx.Conn())
	require.NoError(t, <-done)
	require.NotNil(t, gtx.Conn())
	g.Close()
}

// TestRowsAcrossClose: Rows opened before Close read as closed after it
// (Next false, Err pgx.ErrTxClosed), and their Close does nothing.
func TestRowsAcrossClose(t *testing.T) {
	tx, _ := begin(t)
	var g txguard.Guard
	gtx := g.Tx(tx)
	ctx := context.Background()
	rows, err := gtx.Query(ctx, `SELECT generate_series(1, 3)`)
	require.NoError(t, err)
	require.True(t, rows.Next())
	row := gtx.QueryRow(ctx, `SELECT 1`)

	// Close waits for nothing: no call is in flight while the rows are
	// open between calls.
	g.Close()
	require.False(t, rows.Next())
	require.ErrorIs(t, rows.Err(), pgx.ErrTxClosed)
	require.ErrorIs(t, rows.Scan(new(int)), pgx.ErrTxClosed)
	require.Nil(t, rows.Conn())
	rows.Close()
	require.ErrorIs(t, row.Scan(new(int)), pgx.ErrTxClosed)
}

// TestRowsCutByABusyCall: a Next refused as busy ends the rows for its
// caller with Err saying so, never nil, and Close still closes them once
// the call in flight has returned. The call in flight is on a second
// transaction behind the same Guard: on the rows' own connection pgx
// refuses any call while they are open, so the guard is held only for an
// instant.
func TestRowsCutByABusyCall(t *testing.T) {
	s := pgtest.NewSchema(t)
	tx, _ := beginIn(t, s)
	other, _ := beginIn(t, s)
	var g txguard.Guard
	ctx := context.Background()
	rows, err := g.Tx(tx).Query(ctx, `SELECT generate_series(1, 3)`)
	require.NoError(t, err)
	require.True(t, rows.Next())

	done := inFlight(t, g.Tx(other), `SELECT pg_sleep(0.3)`)
	require.False(t, rows.Next())
	requireBusy(t, rows.Err())
	requireBusy(t, rows.Err(), "a refused Next stays on the rows")
	rows.Close() // refused too: the call is still in flight

	require.NoError(t, <-done)
	requireBusy(t, rows.Err(), "still cut once the guard is free")
	rows.Close()
	_, err = g.Tx(tx).Exec(ctx, `SELECT 1`)
	require.NoError(t, err, "Close closed the rows: the connection takes statements")
	g.Close()
}

// TestCallbackCallsAreBusy: a Batch's callback runs inside the
// BatchResults' call, so a call on the Tx from it is refused as busy (as
// pgx refuses it), where waiting would deadlock; Conn there gives the
// connection SendBatch kept.
func TestCallbackCallsAreBusy(t *testing.T) {
	tx, rows := begin(t)
	var g txguard.Guard
	gtx := g.Tx(tx)
	ctx := context.Background()
	b := &pgx.Batch{}
	var inCallback error
	var conn *pgx.Conn
	b.Queue(`INSERT INTO t VALUES (1)`).Exec(func(pgconn.CommandTag) error {
		_, inCallback = gtx.Exec(ctx, `INSERT INTO t VALUES (2)`)
		conn = gtx.Conn()
		return nil
	})
	require.NoError(t, gtx.SendBatch(ctx, b).Close())
	requireBusy(t, inCallback)
	require.NotNil(t, conn)
	g.Close()
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, int64(1), rows())
}

// TestSavepointsBehindTheGuard: a savepoint of the guarded Tx is guarded by
// the same Guard.
func TestSavepointsBehindTheGuard(t *testing.T) {
	tx, rows := begin(t)
	var g txguard.Guard
	ctx := context.Background()
	sp, err := g.Tx(tx).Begin(ctx)
	require.NoError(t, err)
	_, err = sp.Exec(ctx, `INSERT INTO t VALUES (1)`)
	require.NoError(t, err)
	g.Close()
	_, err = sp.Exec(ctx, `INSERT INTO t VALUES (2)`)
	require.ErrorIs(t, err, pgx.ErrTxClosed)
	require.ErrorIs(t, sp.Commit(ctx), pgx.ErrTxClosed)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, int64(1), rows(), "the savepoint was not rolled back by the refused Commit")
}

// TestLargeObjectsOnceClosed: once the guard is closed, LargeObjects are
// pgx's zero value, whose calls panic, as a closed claim's Tx gives.
func TestLargeObjectsOnceClosed(t *testing.T) {
	tx, _ := begin(t)
	var g txguard.Guard
	gtx := g.Tx(tx)
	g.Close()
	lo := gtx.LargeObjects()
	require.Panics(t, func() { _, _ = lo.Create(context.Background(), 0) })
}

// TestBatchThatBeginsATx: the Tx behind the guard refuses a batch that
// begins a transaction (pgx's Tx does), so its results' Tx is a closed one.
func TestBatchThatBeginsATx(t *testing.T) {
	tx, rows := begin(t)
	var g txguard.Guard
	ctx := context.Background()
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(`INSERT INTO t VALUES (1)`)
	br := g.Tx(tx).SendBatch(ctx, b)
	_, err := br.Exec()
	require.ErrorContains(t, err, "Batch.BeginTx cannot be used within a transaction")
	require.ErrorIs(t, br.Tx().Commit(ctx), pgx.ErrTxClosed)
	_ = br.Close()
	g.Close()
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, int64(0), rows())
}
