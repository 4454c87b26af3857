package dedupactivity_test

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

// sqlTracer is a pgx QueryTracer, BatchTracer and PrepareTracer, as otelpgx
// is: it records every statement sent or prepared and every error one
// returned.
type sqlTracer struct {
	mu     sync.Mutex
	sql    []string
	errors []error
}

// tracingPool is a pool to url whose connections' Tracer is the returned
// sqlTracer.
func tracingPool(t *testing.T, url string) (*pgxpool.Pool, *sqlTracer) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	tracer := &sqlTracer{}
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, tracer
}

func (r *sqlTracer) add(sql string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sql = append(r.sql, sql)
	if err != nil {
		r.errors = append(r.errors, err)
	}
}

func (r *sqlTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.add(d.SQL, nil)
	return ctx
}

func (r *sqlTracer) TraceQueryEnd(_ context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if d.Err != nil {
		r.add("(query end)", d.Err)
	}
}

func (r *sqlTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (r *sqlTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	r.add(d.SQL, d.Err)
}

func (r *sqlTracer) TraceBatchEnd(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	if d.Err != nil {
		r.add("(batch end)", d.Err)
	}
}

func (r *sqlTracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, d pgx.TracePrepareStartData) context.Context {
	r.add("(prepare) "+d.SQL, nil)
	return ctx
}

func (r *sqlTracer) TracePrepareEnd(_ context.Context, _ *pgx.Conn, d pgx.TracePrepareEndData) {
	if d.Err != nil {
		r.add("(prepare end)", d.Err)
	}
}

func (r *sqlTracer) saw(fragment string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.sql {
		if strings.Contains(s, fragment) {
			return true
		}
	}
	return false
}

// TestNoErrorsAsControlFlow: claims, duplicates (one found waiting on a
// concurrent attempt), mismatches and discarded results leave no ERROR in
// the server log and no error in a pgx tracer, which sees every statement
// the claim sends.
func TestNoErrorsAsControlFlow(t *testing.T) {
	t.Parallel()
	c := pgtest.NewCluster(t)
	ctx := context.Background()
	pool, tracer := tracingPool(t, c.URL())
	_, err := pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL)`)
	require.NoError(t, err)
	post := func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		var p Posting
		err := tx.QueryRow(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2) RETURNING id`, in.Account, in.Amount).Scan(&p.EntryID)
		time.Sleep(100 * time.Millisecond) // a concurrent attempt waits on the claim
		return p, err
	}
	logBefore, err := os.ReadFile(c.LogPath())
	require.NoError(t, err)

	for _, opts := range []dedupactivity.Options{{}, {DiscardResults: true, Table: "discarding"}, {MismatchPolicy: dedupactivity.MismatchReturnStored, Table: "lenient"}} {
		d, err := dedupactivity.New(pool, opts)
		require.NoError(t, err)
		require.NoError(t, d.Migrate(ctx))
		// A business key claims first; a run-scoped identity's claim rides
		// with the effect's first statement, as a look. Concurrent riding
		// deliveries are not a normal path (Temporal does not run one
		// attempt twice at once): TestConcurrentRidingDeliveries.
		for _, id := range []dedupactivity.Identity{
			{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "k"},
			{Kind: dedupactivity.KindActivity, Namespace: "default", WorkflowID: "w", RunID: "r", ActivityID: "1"},
		} {
			in := Transfer{Account: "a", Amount: 1}
			if id.Kind == dedupactivity.KindBusinessKey {
				var wg sync.WaitGroup
				outcomes := make([]dedupactivity.Outcome, 2)
				for i := range 2 { // at once: one claims, the other waits and is a duplicate
					wg.Add(1)
					go func() {
						defer wg.Done()
						var err error
						_, outcomes[i], err = dedupactivity.Do(ctx, d, id, in, post)
						assert.NoError(t, err)
					}()
				}
				wg.Wait()
				require.ElementsMatch(t, []dedupactivity.Outcome{dedupactivity.OutcomeClaimed, dedupactivity.OutcomeDuplicate}, outcomes)
			} else {
				_, outcome, err := dedupactivity.Do(ctx, d, id, in, post)
				require.NoError(t, err)
				require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
			}
			_, outcome, err := dedupactivity.Do(ctx, d, id, in, post)
			require.NoError(t, err)
			require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
			if id.Kind == dedupactivity.KindBusinessKey { // run-scoped inputs are not compared
				_, outcome, _ = dedupactivity.Do(ctx, d, id, Transfer{Account: "a", Amount: 2}, post)
				require.Equal(t, dedupactivity.OutcomePayloadMismatch, outcome)
			}
		}
		_, err = d.Prune(ctx)
		require.NoError(t, err)
	}

	var ledger int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM ledger`).Scan(&ledger))
	require.Equal(t, 6, ledger, "one effect per table and identity")
	require.Empty(t, tracer.errors, "no statement failed")
	for _, fragment := range []string{`(prepare) INSERT INTO "dedup_marker"`, `INSERT INTO "dedup_marker"`, `UPDATE "dedup_marker" SET result`, `FROM "dedup_marker" WHERE id_hash`} {
		require.True(t, tracer.saw(fragment), "the tracer saw %s", fragment)
	}
	logAfter, err := os.ReadFile(c.LogPath())
	require.NoError(t, err)
	added := string(logAfter[len(logBefore):])
	require.NotContains(t, added, "ERROR", "server log:\n%s", added)
}
