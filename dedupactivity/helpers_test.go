package dedupactivity_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

// Transfer is the test effect's input: post Amount to Account.
type Transfer struct {
	Account string
	Amount  int64
}

// Posting is the test effect's result.
type Posting struct {
	EntryID int64
	Balance int64
}

type testBundle struct {
	schema *pgtest.Schema
	pool   *pgxpool.Pool
	d      *dedupactivity.Deduper
	// effects counts effect bodies that got past their first statement. On
	// a duplicate whose claim rode with that statement (see
	// TestDuplicateWhoseClaimRode) the statement fails, rolled back.
	effects atomic.Int64
}

// setup gives the test its own schema with a migrated marker table and a
// small ledger.
func setup(t *testing.T, opts dedupactivity.Options) *testBundle {
	t.Helper()
	return setupTB(t, opts)
}

func setupTB(t testing.TB, opts dedupactivity.Options) *testBundle {
	t.Helper()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	d, err := dedupactivity.New(s.Pool, opts)
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	_, err = s.Pool.Exec(ctx, `
CREATE TABLE account (id text PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
CREATE TABLE ledger (id bigserial PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL);
INSERT INTO account (id) VALUES ('a'), ('b');`)
	require.NoError(t, err)
	return &testBundle{schema: s, pool: s.Pool, d: d}
}

// post is the effect: one ledger row and a balance update, through tx.
func (b *testBundle) post(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
	var p Posting
	if err := tx.QueryRow(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2) RETURNING id`, in.Account, in.Amount).Scan(&p.EntryID); err != nil {
		return p, err
	}
	b.effects.Add(1)
	err := tx.QueryRow(ctx, `UPDATE account SET balance = balance + $2 WHERE id = $1 RETURNING balance`, in.Account, in.Amount).Scan(&p.Balance)
	return p, err
}

// claimAndPost is ClaimTx's use as its doc shows it: claim id in tx,
// apply post through tx, complete with its result.
func (b *testBundle) claimAndPost(ctx context.Context, tx pgx.Tx, id dedupactivity.Identity, in Transfer) error {
	c, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, id, in)
	if err != nil {
		return err
	}
	p, err := b.post(ctx, tx, in)
	if err != nil {
		return err
	}
	return c.Complete(ctx, p)
}

func (b *testBundle) count(t testing.TB, query string, args ...any) int64 {
	t.Helper()
	var n int64
	require.NoError(t, b.pool.QueryRow(context.Background(), query, args...).Scan(&n))
	return n
}

func (b *testBundle) ledgerRows(t *testing.T) int64 { return b.count(t, `SELECT count(*) FROM ledger`) }
func (b *testBundle) markers(t *testing.T) int64 {
	return b.count(t, `SELECT count(*) FROM dedup_marker`)
}

// deliver runs fn as activity name in a new test activity environment. Every
// new environment has the same workflow ID, run ID and first activity ID, so
// each call is a delivery of the same event. It returns the error exactly as
// the activity function returned it to the SDK (so errors.Is sees sentinels),
// or, if the function panicked, the SDK's error.
func deliver[In, Out any](t *testing.T, name string, fn func(context.Context, In) (Out, error), in In) (Out, error) {
	t.Helper()
	var raw error
	driver := func(ctx context.Context, in In) (Out, error) {
		out, err := fn(ctx, in)
		raw = err
		return out, err
	}
	var s testsuite.WorkflowTestSuite
	env := s.NewTestActivityEnvironment()
	env.RegisterActivityWithOptions(driver, activity.RegisterOptions{Name: name})
	var out Out
	val, err := env.ExecuteActivity(name, in)
	if err != nil {
		if raw != nil {
			return out, raw
		}
		return out, err
	}
	require.NoError(t, val.Get(&out))
	return out, nil
}

// runPost runs fn as activity Post of postWorkflow in a new workflow test
// environment, with workflowID when it is not empty: there a failed attempt
// is retried as a worker retries it (attempt 2 on), unlike deliver's
// activity environment. It returns the workflow's result or error.
func runPost(t *testing.T, fn func(context.Context, Transfer) (Posting, error), workflowID string, in Transfer) (Posting, error) {
	t.Helper()
	var s testsuite.WorkflowTestSuite
	env := s.NewTestWorkflowEnvironment()
	env.RegisterActivityWithOptions(fn, activity.RegisterOptions{Name: "Post"})
	if workflowID != "" {
		env.SetStartWorkflowOptions(clientStartOptions(workflowID))
	}
	env.ExecuteWorkflow(postWorkflow, in)
	require.True(t, env.IsWorkflowCompleted())
	var p Posting
	if err := env.GetWorkflowError(); err != nil {
		return p, err
	}
	require.NoError(t, env.GetWorkflowResult(&p))
	return p, nil
}

// hashOf is the marker's primary key for id.
func hashOf(id dedupactivity.Identity) []byte {
	h := id.Hash()
	return h[:]
}

// holdFirstClaim makes the first claim through b.d stop after inserting its
// marker, inside its transaction, until release is called: holding is closed
// once it holds. Cleanup releases it too, before the test's pool closes, so
// a failing test reports instead of hanging.
func holdFirstClaim(t *testing.T, b *testBundle) (holding <-chan struct{}, release func()) {
	t.Helper()
	h, r := make(chan struct{}), make(chan struct{})
	var once, releaseOnce sync.Once
	release = func() { releaseOnce.Do(func() { close(r) }) }
	t.Cleanup(release)
	dedupactivity.SetAfterClaimHook(b.d, func(ctx context.Context, tx pgx.Tx) error {
		once.Do(func() { close(h); <-r })
		return nil
	})
	return h, release
}

// heldEvent is an event whose first delivery, through b.d, holds its claim
// open (holdFirstClaim) once heldEvent returns; releaseHeld lets it commit
// and requires that it did.
func heldEvent(t *testing.T, b *testBundle) (id dedupactivity.Identity, in Transfer, releaseHeld func()) {
	t.Helper()
	holding, release := holdFirstClaim(t, b)
	id = dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "held"}
	in = Transfer{Account: "a", Amount: 1}
	holder := make(chan error, 1)
	go func() { _, _, err := dedupactivity.Do(context.Background(), b.d, id, in, b.post); holder <- err }()
	<-holding
	return id, in, func() {
		t.Helper()
		release()
		require.NoError(t, <-holder)
	}
}

// countingPool is a one-connection pool to b's schema whose client writes
// (round trips) are counted; configure, when not nil, adjusts its
// configuration first.
func countingPool(t *testing.T, b *testBundle, configure func(*pgxpool.Config)) (*pgxpool.Pool, *atomic.Int64) {
	t.Helper()
	var writes atomic.Int64
	cfg, err := pgxpool.ParseConfig(b.schema.URL)
	require.NoError(t, err)
	cfg.MaxConns = 1
	if configure != nil {
		configure(cfg)
	}
	pgtest.CountRoundTrips(cfg.ConnConfig, &writes)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, &writes
}

// newPool is a pool to b's schema whose configuration configure adjusts.
func (b *testBundle) newPool(t *testing.T, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(b.schema.URL)
	require.NoError(t, err)
	configure(cfg)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// gaugeValues are the values of the gauge name in one collection of
// reader.
func gaugeValues(t *testing.T, reader *sdkmetric.ManualReader, name string) []float64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	var got []float64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				for _, dp := range m.Data.(metricdata.Gauge[float64]).DataPoints {
					got = append(got, dp.Value)
				}
			}
		}
	}
	return got
}

// countingDeduper is a Deduper with default Options on a countingPool.
func countingDeduper(t *testing.T, b *testBundle, configure func(*pgxpool.Config)) (*dedupactivity.Deduper, *pgxpool.Pool, *atomic.Int64) {
	t.Helper()
	pool, writes := countingPool(t, b, configure)
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)
	return d, pool, writes
}
