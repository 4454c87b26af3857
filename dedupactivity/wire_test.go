package dedupactivity_test

// The claim's round trips (wire.go): statements prepared by name once per
// connection that caches statements, and unnamed on any other; what a pgx
// tracer sees of them; and a connection that lost them.

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// preparedByClaim counts the statements the claim prepared on pool's one
// connection (pg_prepared_statements is the session's own).
func preparedByClaim(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var n int64
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'dedupactivity\_%'`).Scan(&n))
	return n
}

// TestStatementsLostOnTheConnection: when the claim's prepared statements
// are gone from a connection (pgx's Conn.DeallocateAll, which resets pgx's
// own cache too; a pooler that moved the session), the first round trip,
// which then ran nothing, is prepared again and sent once more: claims,
// riding claims and duplicates go on. Effects are counted with SQL.
func TestStatementsLostOnTheConnection(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	pool, _ := countingPool(t, b, nil) // one connection
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)
	in := Transfer{Account: "a", Amount: 1}
	key := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "k"}
	_, _, err = dedupactivity.Do(ctx, d, runScoped("warm"), in, b.post)
	require.NoError(t, err)
	prepared := preparedByClaim(t, pool)
	require.Positive(t, prepared)

	for i, id := range []dedupactivity.Identity{runScoped("ride"), key, runScoped("ride"), key} {
		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		require.NoError(t, conn.Conn().DeallocateAll(ctx))
		conn.Release()
		require.Zero(t, preparedByClaim(t, pool))
		_, outcome, err := dedupactivity.Do(ctx, d, id, in, b.post)
		require.NoError(t, err, "delivery %d", i)
		want := dedupactivity.OutcomeClaimed
		if i >= 2 {
			want = dedupactivity.OutcomeDuplicate
		}
		require.Equal(t, want, outcome, "delivery %d", i)
		again := prepared
		if id.Kind == dedupactivity.KindBusinessKey {
			again-- // the claim's own, not the effect's statement, which did not ride
		}
		require.Equal(t, again, preparedByClaim(t, pool), "delivery %d prepared them again", i)
	}
	require.Equal(t, int64(3), b.ledgerRows(t), "warm, ride and k, once each")
	require.Equal(t, int64(3), b.markers(t))
}

// TestEffectStatementsPreparedAreBounded: a connection keeps at most 128 of
// the effects' riding statements prepared, deallocating the oldest, however
// many different first statements the effects send.
func TestEffectStatementsPreparedAreBounded(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	pool, _ := countingPool(t, b, nil)
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)
	insert := func(n int) dedupactivity.EffectFunc[Transfer, int64] {
		return func(ctx context.Context, tx pgx.Tx, in Transfer) (id int64, err error) {
			return id, tx.QueryRow(ctx, fmt.Sprintf(`INSERT INTO ledger (account, amount) VALUES ($1, $2) RETURNING id /* %d */`, n), in.Account, in.Amount).Scan(&id)
		}
	}
	_, _, err = dedupactivity.Do(ctx, d, runScoped("warm"), Transfer{Account: "a", Amount: 1}, insert(-1))
	require.NoError(t, err)
	own := preparedByClaim(t, pool) - 1 // the claim's own, without the warm-up's effect statement
	const n = 140
	for i := range n {
		_, outcome, err := dedupactivity.Do(ctx, d, runScoped(fmt.Sprint(i)), Transfer{Account: "a", Amount: 1}, insert(i))
		require.NoError(t, err, "event %d", i)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	}
	require.Equal(t, own+128, preparedByClaim(t, pool))
	require.Equal(t, int64(n+1), b.ledgerRows(t))
	require.Equal(t, int64(n+1), b.markers(t))
	// The oldest were deallocated; the newest are still prepared.
	var newest, oldest int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE statement LIKE '%/* 139 */%'), count(*) FILTER (WHERE statement LIKE '%/* 0 */%')
FROM pg_prepared_statements WHERE name LIKE 'dedupactivity\_%'`).Scan(&newest, &oldest))
	require.Equal(t, int64(1), newest)
	require.Zero(t, oldest)
}

// batchTracer records what a pgx BatchTracer and QueryTracer are told.
type batchTracer struct {
	mu      sync.Mutex
	batches [][]string // the SQL of each batch started
	queried []pgx.TraceBatchQueryData
	ended   []error
	queries []string // TraceQueryStart
}

func (r *batchTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.queries = append(r.queries, d.SQL)
	return ctx
}

func (r *batchTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *batchTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	var sql []string
	for _, q := range d.Batch.QueuedQueries {
		sql = append(sql, q.SQL)
	}
	r.batches = append(r.batches, sql)
	return ctx
}

func (r *batchTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.queried = append(r.queried, d)
}

func (r *batchTracer) TraceBatchEnd(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ended = append(r.ended, d.Err)
}

// TestTracerSeesTheClaim: a pgx tracer (as otelpgx) sees each of the
// claim's round trips as a batch of its statements, the effect's riding
// statement among them with its arguments, each statement's outcome, and
// the effect's other statements as queries, as it would if pgx sent them.
func TestTracerSeesTheClaim(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	tracer := &batchTracer{}
	pool, _ := countingPool(t, b, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)
	in := Transfer{Account: "a", Amount: 7}
	_, _, err = dedupactivity.Do(ctx, d, runScoped("warm"), in, b.post)
	require.NoError(t, err)
	tracer.mu.Lock()
	tracer.batches, tracer.queried, tracer.ended, tracer.queries = nil, nil, nil, nil
	tracer.mu.Unlock()

	_, outcome, err := dedupactivity.Do(ctx, d, runScoped("1"), in, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)

	tracer.mu.Lock()
	defer tracer.mu.Unlock()
	require.Len(t, tracer.batches, 2, "the look with the first statement; the marker with COMMIT")
	first, last := tracer.batches[0], tracer.batches[1]
	require.Len(t, first, 3)
	require.Equal(t, "BEGIN ISOLATION LEVEL READ COMMITTED", first[0])
	require.Contains(t, first[1], `LEFT JOIN "dedup_marker"`)
	require.Equal(t, `INSERT INTO ledger (account, amount) VALUES ($1, $2) RETURNING id`, first[2])
	require.Len(t, last, 2)
	require.Contains(t, last[0], `INSERT INTO "dedup_marker"`)
	require.Equal(t, "COMMIT", last[1])

	require.Len(t, tracer.queried, 5, "one per statement")
	for i, q := range tracer.queried {
		require.NoError(t, q.Err, q.SQL)
		require.Equal(t, slices.Concat(first, last)[i], q.SQL)
	}
	ride := tracer.queried[2]
	require.Equal(t, []any{"a", int64(7)}, ride.Args, "the riding statement's arguments")
	require.Equal(t, "INSERT 0 1", ride.CommandTag.String())
	require.Equal(t, "COMMIT", tracer.queried[4].CommandTag.String())
	require.Equal(t, []error{nil, nil}, tracer.ended)
	require.Equal(t, []string{`UPDATE account SET balance = balance + $2 WHERE id = $1 RETURNING balance`}, tracer.queries,
		"the effect's second statement goes through pgx")
}

// TestOtherExecModesPrepareNothing: with a QueryExecMode other than
// CacheStatement (what PgBouncer in transaction mode without prepared
// statements needs), the claim leaves no prepared statement on the server
// connection, and the claim goes before the effect.
func TestOtherExecModesPrepareNothing(t *testing.T) {
	t.Parallel()
	for name, mode := range execModes {
		if mode == pgx.QueryExecModeCacheStatement {
			continue
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			ctx := context.Background()
			pool, writes := countingPool(t, b, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			d, err := dedupactivity.New(pool, dedupactivity.Options{})
			require.NoError(t, err)
			in := Transfer{Account: "a", Amount: 1}
			_, _, err = dedupactivity.Do(ctx, d, runScoped("warm"), in, b.post)
			require.NoError(t, err)
			before := writes.Load()
			_, outcome, err := dedupactivity.Do(ctx, d, runScoped("1"), in, b.post)
			require.NoError(t, err)
			require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
			rt := writes.Load() - before
			if mode == pgx.QueryExecModeDescribeExec {
				rt -= 2 // pgx describes each of the effect's two statements in a round trip of its own
			}
			require.Equal(t, int64(4), rt, "BEGIN and claim, two statements, result and COMMIT")
			_, outcome, err = dedupactivity.Do(ctx, d, runScoped("1"), in, b.post)
			require.NoError(t, err)
			require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
			require.Zero(t, preparedByClaim(t, pool))
			require.Equal(t, int64(2), b.ledgerRows(t))
		})
	}
}
