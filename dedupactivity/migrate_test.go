package dedupactivity_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

func TestMigrateIsIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	d, err := dedupactivity.New(s.Pool, dedupactivity.Options{Schema: s.Name + "_own", Table: "markers"})
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = s.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+s.Name+`_own CASCADE`) })

	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- d.Migrate(ctx) }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, d.Migrate(ctx))

	var versions int
	require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM `+s.Name+`_own.markers_migration`).Scan(&versions))
	migs, err := dedupactivity.Migrations()
	require.NoError(t, err)
	require.Equal(t, len(migs), versions)

	// The configured table and its index exist in the configured schema.
	var idx int
	require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = 'markers'`, s.Name+"_own").Scan(&idx))
	require.GreaterOrEqual(t, idx, 2)
}

func TestMigrationFilesWorkAsTheyAre(t *testing.T) {
	t.Parallel()
	layouts := map[string]func() ([]dedupactivity.Migration, error){
		"default":     dedupactivity.Migrations,
		"partitioned": dedupactivity.PartitionedMigrations,
	}
	for name, load := range layouts {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t)
			ctx := context.Background()
			migs, err := load()
			require.NoError(t, err)
			require.NotEmpty(t, migs)
			for _, m := range migs {
				require.Contains(t, m.Up, "dedup_marker")
				_, err := s.Pool.Exec(ctx, m.Up)
				require.NoError(t, err, "up %d", m.Version)
			}
			for i := len(migs) - 1; i >= 0; i-- {
				_, err := s.Pool.Exec(ctx, migs[i].Down)
				require.NoError(t, err, "down %d", migs[i].Version)
			}
			var n int
			require.NoError(t, s.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM pg_tables WHERE schemaname = $1)
	+ (SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1)`, s.Name).Scan(&n))
			require.Zero(t, n, "down migrations remove every table and function")
		})
	}
}

func TestPrune(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	fn := dedupactivity.Wrap(b.d, b.post)
	in := Transfer{Account: "a", Amount: 1}
	_, err := deliver(t, "Post", fn, in)
	require.NoError(t, err)

	// Unexpired markers stay.
	n, err := b.d.Prune(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	_, err = deliver(t, "Post", fn, in)
	require.NoError(t, err)
	require.Equal(t, int64(1), b.effects.Load())

	// Expired markers go, and the event can be claimed again.
	_, err = b.pool.Exec(ctx, `UPDATE dedup_marker SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	n, err = b.d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	_, err = deliver(t, "Post", fn, in)
	require.NoError(t, err)
	require.Equal(t, int64(2), b.effects.Load())
}

func TestPruneBatchesAndRetentionBound(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{Retention: time.Minute})
	ctx := context.Background()
	// 2,500 expired markers and 10 live ones.
	_, err := b.pool.Exec(ctx, `
INSERT INTO dedup_marker (id_hash, identity, activity_type, fingerprint, fingerprint_alg, attempt, expires_at)
SELECT sha256(int4send(g)), int4send(g), 'T', '\x00', 1, 1,
       CASE WHEN g <= 2500 THEN now() - interval '1 hour' ELSE now() + interval '1 hour' END
FROM generate_series(1, 2510) g`)
	require.NoError(t, err)
	n, err := b.d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(2500), n)
	require.Equal(t, int64(10), b.markers(t))

	// A new marker is kept past the activity's ScheduleToClose bound (10
	// minutes in the test environment) when that is longer than Retention.
	fn := dedupactivity.Wrap(b.d, b.post)
	_, err = deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	var ttl time.Duration
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT expires_at - claimed_at FROM dedup_marker WHERE activity_type = 'Post'`).Scan(&ttl))
	require.InDelta(t, (10 * time.Minute).Seconds(), ttl.Seconds(), 5)

	long := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithRetention(48*time.Hour),
		dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return in.Account, nil }))
	_, err = deliver(t, "Long", long, Transfer{Account: "b", Amount: 1})
	require.NoError(t, err)
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT expires_at - claimed_at FROM dedup_marker WHERE activity_type = 'Long'`).Scan(&ttl))
	require.InDelta(t, (48 * time.Hour).Seconds(), ttl.Seconds(), 5)
}

func TestRedeliveryWarning(t *testing.T) {
	t.Parallel()
	day := 24 * time.Hour
	cases := map[string]struct {
		opts workflow.ActivityOptions
		warn bool
	}{
		"ScheduleToCloseWithin": {workflow.ActivityOptions{ScheduleToCloseTimeout: time.Hour}, false},
		"ScheduleToCloseBeyond": {workflow.ActivityOptions{ScheduleToCloseTimeout: 40 * day}, true},
		"UnlimitedRetries":      {workflow.ActivityOptions{StartToCloseTimeout: time.Minute}, true},
		"BoundedRetriesWithin":  {workflow.ActivityOptions{StartToCloseTimeout: time.Minute, RetryPolicy: &temporal.RetryPolicy{MaximumAttempts: 5, MaximumInterval: time.Minute}}, false},
		"BoundedRetriesTooLong": {workflow.ActivityOptions{StartToCloseTimeout: time.Hour, RetryPolicy: &temporal.RetryPolicy{MaximumAttempts: 1000, MaximumInterval: time.Hour}}, true},
		"ZeroAttemptsUnlimited": {workflow.ActivityOptions{StartToCloseTimeout: time.Minute, RetryPolicy: &temporal.RetryPolicy{}}, true},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			w := dedupactivity.RedeliveryWarning("Post", c.opts, dedupactivity.DefaultRetention)
			require.Equal(t, c.warn, w != "", w)
		})
	}
}

// TestUpgradeFrom002: a table made by an earlier version (migrations 001 and
// 002, markers written by the claim of that version: insert, then update the
// result) is upgraded by Migrate, which applies only what is new, and its
// markers are duplicates for this version's claim.
func TestUpgradeFrom002(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	migs, err := dedupactivity.Migrations()
	require.NoError(t, err)
	_, err = s.Pool.Exec(ctx, `CREATE TABLE dedup_marker_migration (
	version    integer     PRIMARY KEY,
	name       text        NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now())`)
	require.NoError(t, err)
	for _, m := range migs[:2] {
		_, err := s.Pool.Exec(ctx, m.Up)
		require.NoError(t, err)
		_, err = s.Pool.Exec(ctx, `INSERT INTO dedup_marker_migration (version, name) VALUES ($1, $2)`, m.Version, m.Name)
		require.NoError(t, err)
	}

	// A marker written by the earlier claim, with its stored result.
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "old"}
	in := Transfer{Account: "a", Amount: 4}
	require.NoError(t, commitOldProtocolMarker(ctx, s.Pool, id, in, Posting{EntryID: 7, Balance: 4}))

	d, err := dedupactivity.New(s.Pool, dedupactivity.Options{})
	require.NoError(t, err)
	var ran int
	post := func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		ran++
		return Posting{EntryID: 100, Balance: in.Amount}, nil
	}
	_, _, err = dedupactivity.Do(ctx, d, id, in, post)
	require.ErrorIs(t, err, dedupactivity.ErrNotMigrated, "this version's claim needs migration 003")

	require.NoError(t, d.Migrate(ctx))
	rows, err := s.Pool.Query(ctx, `SELECT version FROM dedup_marker_migration ORDER BY version`)
	require.NoError(t, err)
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int])
	require.NoError(t, err)
	require.Equal(t, []int{1, 2, 3}, versions)

	got, outcome, err := dedupactivity.Do(ctx, d, id, in, post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, Posting{EntryID: 7, Balance: 4}, got, "the result the earlier version stored")
	_, outcome, err = dedupactivity.Do(ctx, d, dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "new"}, in, post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	require.Equal(t, 1, ran)
}
