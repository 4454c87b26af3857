package dedupactivity_test

// The claim's round trips (wire.go): statements prepared by name once per
// connection that caches statements, and unnamed on any other; what a pgx
// tracer sees of them; and a connection that lost them.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// sqlStateOf is err's SQLSTATE, or "".
func sqlStateOf(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

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

// TestPreparedStatementsAreBounded: a connection keeps at most 256 of the
// claim's and the effects' statements prepared, deallocating the least
// recently used, however many different first statements the effects send
// and however many marker tables (a Deduper per tenant schema) share it;
// a claim whose statements were deallocated prepares them again.
func TestPreparedStatementsAreBounded(t *testing.T) {
	t.Parallel()
	t.Run("EffectStatements", func(t *testing.T) {
		t.Parallel()
		b := setup(t, dedupactivity.Options{})
		ctx := context.Background()
		d, pool, _ := countingDeduper(t, b, nil)
		insert := func(n int) dedupactivity.EffectFunc[Transfer, int64] {
			return func(ctx context.Context, tx pgx.Tx, in Transfer) (id int64, err error) {
				return id, tx.QueryRow(ctx, fmt.Sprintf(`INSERT INTO ledger (account, amount) VALUES ($1, $2) RETURNING id /* %d */`, n), in.Account, in.Amount).Scan(&id)
			}
		}
		const n = 270
		for i := range n {
			_, outcome, err := dedupactivity.Do(ctx, d, runScoped(fmt.Sprint(i)), Transfer{Account: "a", Amount: 1}, insert(i))
			require.NoError(t, err, "event %d", i)
			require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
		}
		require.Equal(t, int64(256), preparedByClaim(t, pool))
		require.Equal(t, int64(n), b.ledgerRows(t))
		require.Equal(t, int64(n), b.markers(t))
		// The oldest went, the newest and the claim's own stayed.
		var newest, oldest, own int64
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE statement LIKE '%/* 269 */%'), count(*) FILTER (WHERE statement LIKE '%/* 0 */%'),
	count(*) FILTER (WHERE statement LIKE '%dedup_marker%')
FROM pg_prepared_statements WHERE name LIKE 'dedupactivity\_%'`).Scan(&newest, &oldest, &own))
		require.Equal(t, int64(1), newest)
		require.Zero(t, oldest)
		require.Positive(t, own)
	})
	t.Run("MarkerTables", func(t *testing.T) {
		t.Parallel()
		b := setup(t, dedupactivity.Options{})
		ctx := context.Background()
		pool, _ := countingPool(t, b, nil)
		const tenants = 40 // a dozen statements each
		var ds []*dedupactivity.Deduper
		for i := range tenants {
			schema := fmt.Sprintf("%s_tenant%d", b.schema.Name, i)
			_, err := pool.Exec(ctx, `CREATE SCHEMA `+schema)
			require.NoError(t, err)
			d, err := dedupactivity.New(pool, dedupactivity.Options{Schema: schema})
			require.NoError(t, err)
			require.NoError(t, d.Migrate(ctx))
			ds = append(ds, d)
		}
		for round := range 2 { // the second round finds the first tenants' statements deallocated
			for i, d := range ds {
				_, outcome, err := dedupactivity.Do(ctx, d, runScoped(fmt.Sprint(round)), Transfer{Account: "a", Amount: 1}, b.post)
				require.NoError(t, err, "tenant %d, round %d", i, round)
				require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
				require.LessOrEqual(t, preparedByClaim(t, pool), int64(256))
			}
		}
		require.Equal(t, int64(2*tenants), b.ledgerRows(t))
	})
}

// TestStaleRidingStatement: the effect's first statement, prepared by the
// claim, no longer matches its table (SQLSTATE 0A000, a column was added).
// A duplicate whose claim rode with it still returns the stored result; a
// new event gets the error, which is retryable, and the next delivery
// prepares the statement again, deallocating the stale one.
func TestStaleRidingStatement(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	d, pool, _ := countingDeduper(t, b, nil)
	_, err := pool.Exec(ctx, `CREATE TABLE wide (id int PRIMARY KEY, v int); INSERT INTO wide VALUES (1, 2)`)
	require.NoError(t, err)
	effect := func(ctx context.Context, tx pgx.Tx, in Transfer) (int64, error) {
		rows, _ := tx.Query(ctx, `SELECT * FROM wide WHERE id = $1`, 1)
		rows.Close()
		if err := rows.Err(); err != nil {
			return 0, err
		}
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2) RETURNING id`, in.Account, in.Amount).Scan(&id)
		return id, err
	}
	in := Transfer{Account: "a", Amount: 1}
	first, outcome, err := dedupactivity.Do(ctx, d, runScoped("x"), in, effect)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	prepared := preparedByClaim(t, pool)

	_, err = pool.Exec(ctx, `ALTER TABLE wide ADD COLUMN w int`)
	require.NoError(t, err)
	dup, outcome, err := dedupactivity.Do(ctx, d, runScoped("x"), in, effect)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, first, dup)

	// The duplicate found the statement stale: the next delivery prepares
	// it again.
	_, outcome, err = dedupactivity.Do(ctx, d, runScoped("y"), in, effect)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)

	_, err = pool.Exec(ctx, `ALTER TABLE wide ADD COLUMN z int`)
	require.NoError(t, err)
	_, outcome, err = dedupactivity.Do(ctx, d, runScoped("z"), in, effect)
	require.Equal(t, "0A000", sqlStateOf(err), "%v", err)
	require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
	_, outcome, err = dedupactivity.Do(ctx, d, runScoped("z"), in, effect)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	require.Equal(t, prepared, preparedByClaim(t, pool), "the stale statements were deallocated")
	require.Equal(t, int64(3), b.ledgerRows(t))
	require.Equal(t, int64(3), b.markers(t))
}

// TestFirstStatementThatCannotBePrepared: an effect's first statement that
// the server will not prepare (here the name of a statement pgx prepared on
// the connection, which pgx runs as that statement) is tried once per
// connection, then goes through pgx after the claim, as on a connection
// that does not cache statements.
func TestFirstStatementThatCannotBePrepared(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	d, _, writes := countingDeduper(t, b, func(c *pgxpool.Config) {
		c.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			_, err := conn.Prepare(ctx, "ins", `INSERT INTO ledger (account, amount) VALUES ($1, $2)`)
			return err
		}
	})
	effect := func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
		_, err := tx.Exec(ctx, "ins", in.Account, in.Amount)
		return 0, err
	}
	_, _, err := dedupactivity.Do(ctx, d, runScoped("warm"), Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)
	var rts []int64
	for i := range 3 {
		before := writes.Load()
		_, outcome, err := dedupactivity.Do(ctx, d, runScoped(fmt.Sprint(i)), Transfer{Account: "a", Amount: 1}, effect)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
		rts = append(rts, writes.Load()-before)
	}
	require.Equal(t, []int64{4, 3, 3}, rts, "a failed prepare once, then: BEGIN and claim; the statement; result and COMMIT")
	require.Equal(t, int64(4), b.ledgerRows(t))
}

// TestReplacedConnectionInAnotherMode: a connection that caches statements
// died while idle, and the pool's BeforeConnect gives its replacement
// another exec mode: the claim goes first there, and the effect's
// statement through pgx.
func TestReplacedConnectionInAnotherMode(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	var connects atomic.Int32
	d, pool, _ := countingDeduper(t, b, func(c *pgxpool.Config) {
		c.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
		c.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
			if connects.Add(1) > 1 {
				cc.DefaultQueryExecMode = pgx.QueryExecModeExec
			}
			return nil
		}
	})
	_, _, err := dedupactivity.Do(ctx, d, runScoped("warm"), Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)
	var pid uint32
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	_, err = b.pool.Exec(ctx, `SELECT pg_terminate_backend($1, 5000)`, pid)
	require.NoError(t, err)

	_, outcome, err := dedupactivity.Do(ctx, d, runScoped("1"), Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	require.Equal(t, int32(2), connects.Load())
	require.Zero(t, preparedByClaim(t, pool))
	require.Equal(t, int64(2), b.ledgerRows(t))
	require.Equal(t, int64(2), b.markers(t))
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
	d, _, _ := countingDeduper(t, b, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	in := Transfer{Account: "a", Amount: 7}
	_, _, err := dedupactivity.Do(ctx, d, runScoped("warm"), in, b.post)
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
	require.Contains(t, first[1], `SELECT EXISTS (SELECT FROM "dedup_marker"`)
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

// prepareKey holds, in the context TracePrepareStart returns, the name of
// the statement it started.
type prepareKey struct{}

// prepareTracer records what a pgx PrepareTracer is told, beside a
// batchTracer's record.
type prepareTracer struct {
	batchTracer
	started []pgx.TracePrepareStartData
	ended   []error
}

func (r *prepareTracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, d pgx.TracePrepareStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.started = append(r.started, d)
	return context.WithValue(ctx, prepareKey{}, d.Name) // End must get Start's context
}

func (r *prepareTracer) TracePrepareEnd(ctx context.Context, _ *pgx.Conn, d pgx.TracePrepareEndData) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if name, _ := ctx.Value(prepareKey{}).(string); name != r.started[len(r.ended)].Name {
		panic(fmt.Sprintf("prepare end %d has the context of %q, not of %q", len(r.ended), name, r.started[len(r.ended)].Name))
	}
	r.ended = append(r.ended, d.Err)
}

// take returns the claim's prepares started and ended since the last call;
// pgx's own (the effect's other statements, which pgx prepares in its
// statement cache) are left out.
func (r *prepareTracer) take(t *testing.T) (started []pgx.TracePrepareStartData, ended []error) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	require.Len(t, r.ended, len(r.started), "every prepare started ends")
	for i, s := range r.started {
		if strings.HasPrefix(s.Name, "dedupactivity_") {
			started, ended = append(started, s), append(ended, r.ended[i])
		}
	}
	r.started, r.ended = nil, nil
	return started, ended
}

// TestPrepareTraced: the round trip that prepares statements on a
// connection, the claim's own once and each new riding statement once, is
// told to a pgx PrepareTracer (as otelpgx is), statement by statement with
// the server's error when it refused one, and is a dedup.prepare event on
// the attempt's span with the number of statements; an attempt that
// prepares nothing has neither.
func TestPrepareTraced(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	tracer := &prepareTracer{}
	pool, _ := countingPool(t, b, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	spans := tracetest.NewSpanRecorder()
	d, err := dedupactivity.New(pool, dedupactivity.Options{TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))})
	require.NoError(t, err)
	prepareEvent := func() (n int64, ok bool) {
		ended := spans.Ended()
		require.NotEmpty(t, ended)
		for _, ev := range ended[len(ended)-1].Events() {
			if ev.Name == dedupactivity.PrepareEvent {
				require.False(t, ok, "two prepare events on one span")
				for _, kv := range ev.Attributes {
					if kv.Key == dedupactivity.PrepareStatementsKey {
						n, ok = kv.Value.AsInt64(), true
					}
				}
				require.True(t, ok, "the event has no statement count")
			}
		}
		return n, ok
	}
	in := Transfer{Account: "a", Amount: 1}

	// A new connection: the claim's statements and the riding one.
	_, outcome, err := dedupactivity.Do(ctx, d, runScoped("1"), in, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	started, ended := tracer.take(t)
	n, ok := prepareEvent()
	require.True(t, ok)
	require.Equal(t, int64(len(started)), n)
	require.Equal(t, preparedByClaim(t, pool), n)
	require.Equal(t, make([]error, len(started)), ended, "every prepare ended, without an error")
	var sql []string
	for _, s := range started {
		require.Regexp(t, `^dedupactivity_[0-9a-f]+$`, s.Name)
		sql = append(sql, s.SQL)
	}
	require.Contains(t, sql, `INSERT INTO ledger (account, amount) VALUES ($1, $2) RETURNING id`)

	// Nothing new: nothing prepared, no event.
	_, _, err = dedupactivity.Do(ctx, d, runScoped("2"), in, b.post)
	require.NoError(t, err)
	started, _ = tracer.take(t)
	require.Empty(t, started)
	_, ok = prepareEvent()
	require.False(t, ok)

	// A new first statement: that one only.
	const audit = `INSERT INTO ledger (account, amount) VALUES ($1, $2 * 2) RETURNING id`
	_, _, err = dedupactivity.Do(ctx, d, runScoped("3"), in, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		var p Posting
		return p, tx.QueryRow(ctx, audit, in.Account, in.Amount).Scan(&p.EntryID)
	})
	require.NoError(t, err)
	started, ended = tracer.take(t)
	require.Len(t, started, 1)
	require.Equal(t, audit, started[0].SQL)
	require.Equal(t, []error{nil}, ended)
	n, ok = prepareEvent()
	require.True(t, ok)
	require.Equal(t, int64(1), n)

	// A first statement the server refuses: its error, then the claim goes
	// first and the effect's own statement fails as it would anyway.
	const missing = `INSERT INTO no_such_table (x) VALUES ($1)`
	_, outcome, err = dedupactivity.Do(ctx, d, runScoped("4"), in, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		_, err := tx.Exec(ctx, missing, in.Account)
		return Posting{}, err
	})
	require.Equal(t, "42P01", sqlStateOf(err))
	require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
	started, ended = tracer.take(t)
	require.Len(t, started, 1)
	require.Equal(t, missing, started[0].SQL)
	require.Len(t, ended, 1)
	require.Equal(t, "42P01", sqlStateOf(ended[0]))
	n, ok = prepareEvent()
	require.True(t, ok)
	require.Equal(t, int64(1), n)
	require.Equal(t, int64(3), b.ledgerRows(t), "the three effects that could apply")

	// A marker table not migrated: the prepare fails on its first statement
	// that names the table, and every statement after it ends with that
	// error (the server skipped them).
	unmigrated, err := dedupactivity.New(pool, dedupactivity.Options{Table: "unmigrated"})
	require.NoError(t, err)
	_, _, err = dedupactivity.Do(ctx, unmigrated, runScoped("5"), in, b.post)
	require.ErrorIs(t, err, dedupactivity.ErrNotMigrated)
	started, ended = tracer.take(t)
	require.Greater(t, len(started), 2)
	first := slices.IndexFunc(ended, func(err error) bool { return err != nil })
	require.GreaterOrEqual(t, first, 0, "no prepare ended with an error")
	require.Less(t, first, len(ended)-1, "the failure is not the last statement: the test checks nothing after it")
	for _, e := range ended[first:] {
		require.Same(t, ended[first], e)
	}
	require.Equal(t, int64(3), b.ledgerRows(t))
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
			d, pool, writes := countingDeduper(t, b, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			in := Transfer{Account: "a", Amount: 1}
			_, _, err := dedupactivity.Do(ctx, d, runScoped("warm"), in, b.post)
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

// TestLargeObjectsAfterAFailedStatement: large objects asked for after a
// statement of the effect failed fail as any statement would then
// (SQLSTATE 25P02), without a panic, and nothing commits: when the claim
// went first, and when it rode as a look (the marker's key not in yet).
func TestLargeObjectsAfterAFailedStatement(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	for name, id := range bothPaths("lo") {
		t.Run(name, func(t *testing.T) {
			var loErr error
			_, outcome, err := dedupactivity.Do(ctx, b.d, id, Transfer{}, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2)`, "a", 1); err != nil {
					return 0, err
				}
				_, _ = tx.Exec(ctx, `SELECT 1/$1::int`, 0) // failed, and ignored
				lo := tx.LargeObjects()
				_, loErr = lo.Create(ctx, 0)
				return 0, loErr
			})
			require.Equal(t, "25P02", sqlStateOf(loErr), "%v", loErr)
			require.ErrorIs(t, err, loErr)
			require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
			require.Zero(t, b.ledgerRows(t))
			require.Zero(t, b.markers(t))
		})
	}
}

// TestLargeObjectsRefused: large objects asked for while the effect's Rows
// are open (the connection is busy, as pgx says of any call then) cannot
// be given: pgx makes them only over a Tx of its own, which needs a
// statement. Their first call ends the effect, and the attempt fails with
// that refusal, not with pgx's nil dereference; nothing commits. A Tx kept
// past the attempt gives none either: a large-object call on it panics
// (pgx has no LargeObjects that returns pgx.ErrTxClosed), which the test
// pins so that a change shows.
func TestLargeObjectsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	for name, id := range bothPaths("lo-busy") {
		t.Run(name, func(t *testing.T) {
			returned := false
			_, outcome, err := dedupactivity.Do(ctx, b.d, id, Transfer{}, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2)`, "a", 1); err != nil {
					return 0, err
				}
				rows, err := tx.Query(ctx, `SELECT generate_series(1, $1::int)`, 3)
				if err != nil {
					return 0, err
				}
				defer rows.Close()
				lo := tx.LargeObjects()
				_, err = lo.Create(ctx, 0)
				returned = true
				return 0, err
			})
			require.False(t, returned, "the large-object call ended the effect")
			require.ErrorContains(t, err, "conn busy")
			require.ErrorContains(t, err, "LargeObjects")
			require.Equal(t, dedupactivity.OutcomeError, outcome)
			require.Zero(t, b.ledgerRows(t))
			require.Zero(t, b.markers(t))
		})
	}

	var kept pgx.Tx
	_, _, err := dedupactivity.Do(ctx, b.d, runScoped("lo-kept"), Transfer{}, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
		kept = tx
		_, err := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2)`, "a", 1)
		return 0, err
	})
	require.NoError(t, err)
	require.Panics(t, func() {
		lo := kept.LargeObjects()
		_, _ = lo.Create(ctx, 0)
	})
}

// TestLargeObjectsOfAnEndedSavepoint: large objects asked for on a
// savepoint the effect released (or rolled back) are refused, as every
// other call on it is (pgx.ErrTxClosed), instead of writing in the claim's
// transaction outside the savepoint: their first call ends the effect, the
// attempt fails with the refusal, and nothing commits.
func TestLargeObjectsOfAnEndedSavepoint(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	for name, id := range bothPaths("lo-savepoint") {
		t.Run(name, func(t *testing.T) {
			returned := false
			_, outcome, err := dedupactivity.Do(ctx, b.d, id, Transfer{}, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2)`, "a", 1); err != nil {
					return 0, err
				}
				sp, err := tx.Begin(ctx)
				if err != nil {
					return 0, err
				}
				if err := sp.Commit(ctx); err != nil {
					return 0, err
				}
				lo := sp.LargeObjects()
				_, err = lo.Create(ctx, 0)
				returned = true
				return 0, err
			})
			require.False(t, returned, "the large-object call ended the effect")
			require.ErrorIs(t, err, pgx.ErrTxClosed)
			require.ErrorContains(t, err, "LargeObjects")
			require.Equal(t, dedupactivity.OutcomeError, outcome)
			require.Zero(t, b.ledgerRows(t))
			require.Zero(t, b.markers(t))
		})
	}
}

// TestClaimWaitWithGenericPlans: the claim's wait for a concurrent attempt
// stays bounded when its prepared statements run generic plans (after five
// executions PostgreSQL may switch to them; plan_cache_mode forces them
// here), for a claim that goes first and for the marker inserted at COMMIT
// after a look.
func TestClaimWaitWithGenericPlans(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	pool, _ := countingPool(t, b, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_generic_plan"
	})
	d, err := dedupactivity.New(pool, dedupactivity.Options{ClaimWait: 300 * time.Millisecond})
	require.NoError(t, err)
	in := Transfer{Account: "a", Amount: 1}
	for name, id := range bothPaths("generic") {
		func() {
			// Another transaction holds the event's key, uncommitted.
			holder, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			defer holder.Rollback(ctx) // also when a check below fails
			_, err = holder.Exec(ctx, `INSERT INTO dedup_marker (id_hash, attempt, expires_at, activity_type) VALUES ($1, 1, now() + interval '1 hour', 'Post')`, hashOf(id))
			require.NoError(t, err)
			began := time.Now()
			wctx, cancel := context.WithTimeout(ctx, 6*time.Second) // an unbounded wait ends here
			defer cancel()
			_, _, err = dedupactivity.Do(wctx, d, id, in, b.post)
			require.ErrorIs(t, err, dedupactivity.ErrClaimTimeout, name)
			require.Less(t, time.Since(began), 3*time.Second, name)
		}()
		_, outcome, err := dedupactivity.Do(ctx, d, id, in, b.post)
		require.NoError(t, err, name)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome, name)
	}
	var mode string
	require.NoError(t, pool.QueryRow(ctx, `SHOW plan_cache_mode`).Scan(&mode))
	require.Equal(t, "force_generic_plan", mode)
	require.Equal(t, int64(2), b.ledgerRows(t))
}

// TestDeadlineWhilePreparingTheClaim: a deadline that comes while a new
// connection prepares the claim's statements (their Parse waits, here on a
// lock held on the marker table, as partition maintenance may hold it) is
// the claim's, not the effect's: the effect's first statement was not sent.
func TestDeadlineWhilePreparingTheClaim(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	d, _, _ := countingDeduper(t, b, nil)
	holder := lockTable(t, b, "dedup_marker")

	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	in := Transfer{Account: "a", Amount: 1}
	_, outcome, err := dedupactivity.Do(short, d, runScoped("x"), in, b.post)
	require.ErrorIs(t, err, dedupactivity.ErrClaimTimeout)
	require.Equal(t, dedupactivity.OutcomeClaimTimeout, outcome)
	require.NoError(t, holder.Rollback(ctx))

	_, outcome, err = dedupactivity.Do(ctx, d, runScoped("x"), in, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(1), b.markers(t))
}

// TestPlannerErrorIsNotStale: a riding statement that fails with SQLSTATE
// 0A000 from the planner (not the plan cache's "cached plan must not
// change result type") is the effect's error; the connection's prepared
// statements stay, so the next delivery takes no prepare round trip.
func TestPlannerErrorIsNotStale(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	d, pool, writes := countingDeduper(t, b, nil)
	_, err := pool.Exec(ctx, `CREATE TABLE a (id int); CREATE TABLE u (id int)`)
	require.NoError(t, err)
	in := Transfer{Account: "a", Amount: 1}
	_, _, err = dedupactivity.Do(ctx, d, runScoped("warm"), in, b.post)
	require.NoError(t, err)

	outerJoin := func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
		_, err := tx.Exec(ctx, `SELECT a.id FROM a LEFT JOIN u ON u.id = $1 FOR UPDATE OF u`, 1)
		return 0, err
	}
	_, outcome, err := dedupactivity.Do(ctx, d, runScoped("x"), in, outerJoin)
	require.Equal(t, "0A000", sqlStateOf(err), "%v", err)
	require.Equal(t, dedupactivity.OutcomeEffectError, outcome)

	before := writes.Load()
	_, outcome, err = dedupactivity.Do(ctx, d, runScoped("y"), in, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	require.Equal(t, int64(3), writes.Load()-before, "BEGIN, look and the insert; the update; the marker and COMMIT")
	require.Equal(t, int64(2), b.ledgerRows(t))
	require.Equal(t, int64(2), b.markers(t))
}

// TestFirstStatementThatWaitedToBePrepared: an effect's first statement
// whose prepare failed for a reason of the moment (here lock_timeout, its
// table locked) is not held against it: once the lock is gone it is
// prepared by the claim and rides.
func TestFirstStatementThatWaitedToBePrepared(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	d, pool, _ := countingDeduper(t, b, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["lock_timeout"] = "200ms"
	})
	_, err := pool.Exec(ctx, `CREATE TABLE locked (id int)`)
	require.NoError(t, err)
	in := Transfer{Account: "a", Amount: 1}
	_, _, err = dedupactivity.Do(ctx, d, runScoped("warm"), in, b.post)
	require.NoError(t, err)

	const first = `INSERT INTO locked (id) VALUES ($1)`
	effect := func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
		_, err := tx.Exec(ctx, first, 1)
		return 0, err
	}
	holder := lockTable(t, b, "locked")
	_, outcome, err := dedupactivity.Do(ctx, d, runScoped("x"), in, effect)
	require.Equal(t, "55P03", sqlStateOf(err), "%v", err)
	require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
	require.NoError(t, holder.Rollback(ctx))

	_, outcome, err = dedupactivity.Do(ctx, d, runScoped("x"), in, effect)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	var byClaim bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_prepared_statements
		WHERE name LIKE 'dedupactivity\_%' AND statement = $1)`, first).Scan(&byClaim))
	require.True(t, byClaim, "the claim prepared the statement to ride with it")
	var n int64
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM locked`).Scan(&n))
	require.Equal(t, int64(1), n)
	require.Equal(t, int64(2), b.markers(t))
}

// lockTable holds an ACCESS EXCLUSIVE lock on table in a transaction of
// b's pool, until the test rolls it back (or ends).
func lockTable(t *testing.T, b *testBundle, table string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback(ctx) }) // when an assertion fails before
	_, err = holder.Exec(ctx, `LOCK TABLE `+table+` IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	return holder
}

// TestEffectPanicAfterALargeObjectsRefusal: an effect's own panic after
// LargeObjects was refused (and its zero value never used) is the effect's,
// not turned into the refusal (TestLargeObjectsRefused).
func TestEffectPanicAfterALargeObjectsRefusal(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	var counts map[string]int // nil: the effect's own bug
	require.PanicsWithError(t, "assignment to entry in nil map", func() {
		_, _, _ = dedupactivity.Do(ctx, b.d, runScoped("lo-then-own-panic"), Transfer{}, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
			rows, err := tx.Query(ctx, `SELECT generate_series(1, $1::int)`, 3)
			if err != nil {
				return 0, err
			}
			_ = tx.LargeObjects() // refused: the rows are open; never used
			rows.Close()
			counts["x"]++
			return 0, nil
		})
	})
	require.Zero(t, b.markers(t))
}

// TestFirstStatementDeadlineWhilePrepared: the caller's deadline that comes
// while the effect's first statement is prepared to ride with the claim
// (its Parse waits, here on its table's lock, without a lock_timeout) is
// the effect's, as when it comes while the statement runs
// (TestFirstStatementDeadlineIsTheEffects): the claim's own statements
// were prepared and waited for nothing.
func TestFirstStatementDeadlineWhilePrepared(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	d, pool, _ := countingDeduper(t, b, nil)
	_, err := pool.Exec(ctx, `CREATE TABLE locked (id int)`)
	require.NoError(t, err)
	in := Transfer{Account: "a", Amount: 1}
	_, _, err = dedupactivity.Do(ctx, d, runScoped("warm"), in, b.post) // the claim's statements prepared
	require.NoError(t, err)

	holder := lockTable(t, b, "locked")
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, outcome, err := dedupactivity.Do(short, d, runScoped("x"), in, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
		_, err := tx.Exec(ctx, `INSERT INTO locked (id) VALUES ($1)`, 1)
		return 0, err
	})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotErrorIs(t, err, dedupactivity.ErrClaimTimeout)
	require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
	require.NoError(t, holder.Rollback(ctx))
	require.Equal(t, int64(1), b.markers(t))
}
