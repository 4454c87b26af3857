package dedupactivity_test

import (
	"context"
	"fmt"
	"io/fs"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/migrations"
)

// TestMigrateIsIdempotentAndConcurrent: 16 concurrent Migrate calls, two on
// each of 8 tables of one new schema, all succeed.
func TestMigrateIsIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	own := s.Name + "_own"
	t.Cleanup(func() { _, _ = s.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+own+` CASCADE`) })

	var dedupers []*dedupactivity.Deduper
	for i := range 8 {
		d, err := dedupactivity.New(s.Pool, dedupactivity.Options{Schema: own, Table: fmt.Sprintf("markers_%d", i)})
		require.NoError(t, err)
		dedupers = append(dedupers, d, d) // each table twice: 16 calls
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(dedupers))
	for _, d := range dedupers {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- d.Migrate(ctx) }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, dedupers[0].Migrate(ctx))

	var tables, versions int
	require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename ~ '^markers_[0-9]$'`, own).Scan(&tables))
	require.Equal(t, 8, tables)
	require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM `+own+`.markers_0_migration`).Scan(&versions))
	require.Equal(t, 1, versions)
	var idx int
	require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = 'markers_0'`, own).Scan(&idx))
	require.Equal(t, 2, idx, "primary key and expiry index")
}

// TestMigrateMakesAMissingFunction: a claim whose statement names a missing
// function of the marker table fails as ErrNotMigrated, and a table whose
// functions are not all there (one dropped by hand, or made before one was
// added) is migrated again.
func TestMigrateMakesAMissingFunction(t *testing.T) {
	t.Parallel()
	for _, fn := range []string{"dedup_marker_ended", "dedup_marker_moved"} {
		t.Run(fn, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			ctx := context.Background()
			_, err := b.pool.Exec(ctx, `DROP FUNCTION `+fn+`()`)
			require.NoError(t, err)
			id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "k"}
			_, _, err = dedupactivity.Do(ctx, b.d, id, Transfer{Account: "a", Amount: 1}, b.post)
			require.ErrorIs(t, err, dedupactivity.ErrNotMigrated, "its statement names the missing function")
			require.Equal(t, int64(0), b.ledgerRows(t))
			require.NoError(t, b.d.Migrate(ctx))
			_, _, err = dedupactivity.Do(ctx, b.d, id, Transfer{Account: "a", Amount: 1}, b.post)
			require.NoError(t, err)
			require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM pg_proc WHERE proname = $1 AND pronamespace = $2::regnamespace`, fn, b.schema.Name))
		})
	}
}

// TestMigrateWaitsBrieflyForTheTable: a Migrate that has work to do (a
// function missing) behind a long claim transaction gives up its wait for
// the table's lock after migrateLockTimeout with SQLSTATE 55P03, instead
// of waiting as long as that transaction with every new claim queued
// behind its lock request; called again once the table is free, it makes
// the function.
func TestMigrateWaitsBrieflyForTheTable(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `DROP FUNCTION dedup_marker_moved()`)
	require.NoError(t, err)
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer holder.Rollback(ctx)
	_, err = holder.Exec(ctx, `INSERT INTO dedup_marker (id_hash, activity_type, attempt, expires_at) VALUES (sha256('x'), 'T', 1, now() + interval '1 day')`)
	require.NoError(t, err)

	migrated := make(chan error, 1)
	began := time.Now()
	go func() { migrated <- b.d.Migrate(ctx) }()
	select {
	case err = <-migrated:
	case <-time.After(10 * time.Second):
		t.Fatal("Migrate still waits for the long transaction")
	}
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "55P03", pgErr.Code, "%v", err)
	require.ErrorContains(t, err, "held the table")
	require.Less(t, time.Since(began), 5*time.Second)

	require.NoError(t, holder.Rollback(ctx))
	require.NoError(t, b.d.Migrate(ctx))
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM pg_proc WHERE proname = 'dedup_marker_moved' AND pronamespace = $1::regnamespace`, b.schema.Name))
}

// upFiles returns the up SQL files of a layout, as a migration tool reads
// them.
func upFiles(t *testing.T, partitioned bool) []string {
	t.Helper()
	fsys, glob := fs.FS(migrations.FS), "*.up.sql"
	if partitioned {
		fsys, glob = migrations.PartitionedFS, "partitioned/*.up.sql"
	}
	names, err := fs.Glob(fsys, glob)
	require.NoError(t, err)
	require.NotEmpty(t, names)
	var out []string
	for _, n := range names {
		b, err := fs.ReadFile(fsys, n)
		require.NoError(t, err)
		out = append(out, string(b))
	}
	return out
}

// TestMigrationFilesMeetMigrate: the files applied as they are (twice: they
// are idempotent), then Migrate, which finds nothing to do; the down files,
// then Migrate, which makes the table again; claims work after each.
func TestMigrationFilesMeetMigrate(t *testing.T) {
	t.Parallel()
	for _, partitioned := range []bool{false, true} {
		t.Run(fmt.Sprintf("partitioned=%v", partitioned), func(t *testing.T) {
			t.Parallel()
			s := pgtest.NewSchema(t)
			ctx := context.Background()
			for range 2 {
				for _, sql := range upFiles(t, partitioned) {
					_, err := s.Pool.Exec(ctx, sql)
					require.NoError(t, err)
				}
			}
			opts := dedupactivity.Options{}
			if partitioned {
				opts.PartitionInterval = time.Hour
			}
			d, err := dedupactivity.New(s.Pool, opts)
			require.NoError(t, err)
			require.NoError(t, d.Migrate(ctx), "after a tool applied the files")
			var versionTable bool
			require.NoError(t, s.Pool.QueryRow(ctx, `SELECT to_regclass('dedup_marker_migration') IS NOT NULL`).Scan(&versionTable))
			require.False(t, versionTable, "nothing to do: Migrate wrote nothing")

			claim := func(key string) {
				fn := dedupactivity.Wrap(d, func(ctx context.Context, tx pgx.Tx, in int) (int, error) { return in, nil })
				var suite testsuite.WorkflowTestSuite
				env := suite.NewTestActivityEnvironment()
				env.SetTestTimeout(time.Minute)
				env.RegisterActivityWithOptions(fn, activity.RegisterOptions{Name: key})
				_, err := env.ExecuteActivity(key, 1)
				require.NoError(t, err)
				var n int
				require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM dedup_marker WHERE activity_type = $1`, key).Scan(&n))
				require.Equal(t, 1, n)
			}
			claim("AfterTool")

			down, err := fs.ReadFile(migrations.FS, "001_create_dedup_marker.down.sql")
			if partitioned {
				down, err = fs.ReadFile(migrations.PartitionedFS, "partitioned/001_create_dedup_marker.down.sql")
			}
			require.NoError(t, err)
			_, err = s.Pool.Exec(ctx, string(down))
			require.NoError(t, err)
			_, err = d.Prune(ctx)
			require.ErrorIs(t, err, dedupactivity.ErrNotMigrated)
			require.NoError(t, d.Migrate(ctx), "after the down files")
			claim("AfterDown")
		})
	}
}

// TestMigrateRefusesAForeignTable: a table of the marker table's name that
// dedupactivity did not make (an older hand-written recipe's) is refused by
// Migrate, naming the columns it lacks, instead of being taken as migrated
// (the files' CREATE TABLE IF NOT EXISTS leaves it as it is) so that every
// claim fails; and a claim against it is ErrNotMigrated.
func TestMigrateRefusesAForeignTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, ddl := range map[string]string{
		"SomeColumns": `CREATE TABLE dedup_marker (identity_hash bytea PRIMARY KEY, result bytea, expires_at timestamptz)`,
		"NoneOfThem":  `CREATE TABLE dedup_marker (id text PRIMARY KEY, created timestamptz)`,
	} {
		t.Run(name, func(t *testing.T) {
			s := pgtest.NewSchema(t)
			_, err := s.Pool.Exec(ctx, ddl)
			require.NoError(t, err)
			d, err := dedupactivity.New(s.Pool, dedupactivity.Options{})
			require.NoError(t, err)
			err = d.Migrate(ctx)
			require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
			require.ErrorContains(t, err, "activity_type, attempt, claimed_at")
			require.ErrorContains(t, err, "give Options another Table")
			var versions int
			require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_class WHERE relname = 'dedup_marker_migration' AND relnamespace = current_schema()::regnamespace`).Scan(&versions))
			require.Zero(t, versions, "nothing recorded")

			fn := dedupactivity.Wrap(d, func(ctx context.Context, tx pgx.Tx, in int) (int, error) {
				_, err := tx.Exec(ctx, `SELECT $1::int`, in)
				return in, err
			})
			_, err = deliver(t, "Post", fn, 1)
			require.ErrorIs(t, err, dedupactivity.ErrNotMigrated)
		})
	}
}

// TestMigrateRefusesNewerVersion: a version recorded by a newer release of
// the package is refused, naming the versions.
func TestMigrateRefusesNewerVersion(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO dedup_marker_migration (version, name) VALUES (999, 'from_the_future')`)
	require.NoError(t, err)
	err = b.d.Migrate(ctx)
	require.ErrorIs(t, err, dedupactivity.ErrSchemaTooNew)
	require.ErrorContains(t, err, "version 999")
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

// TestPrunersShareAWorker: one worker registers the pruners of two tables,
// and the pruning workflow prunes the table whose activity it is given.
func TestPrunersShareAWorker(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	other, err := dedupactivity.New(b.pool, dedupactivity.Options{Table: "dedup_other"})
	require.NoError(t, err)
	require.NoError(t, other.Migrate(ctx))
	in := Transfer{Account: "a", Amount: 1}
	for _, d := range []*dedupactivity.Deduper{b.d, other} {
		_, err := deliver(t, "Post", dedupactivity.Wrap(d, b.post), in)
		require.NoError(t, err)
	}
	for _, table := range []string{"dedup_marker", "dedup_other"} {
		_, err = b.pool.Exec(ctx, `UPDATE `+table+` SET expires_at = now() - interval '1 second'`)
		require.NoError(t, err)
	}

	var s testsuite.WorkflowTestSuite
	env := s.NewTestWorkflowEnvironment()
	dedupactivity.RegisterPruner(env, b.d)
	dedupactivity.RegisterPruner(env, other)
	require.Equal(t, "DedupPrune:dedup_other", dedupactivity.PruneActivityName(other), "the table's name as it reads, unquoted")
	inSchema, err := dedupactivity.New(b.pool, dedupactivity.Options{Schema: "tenant_a", Table: "dedup_marker"})
	require.NoError(t, err)
	require.Equal(t, "DedupPrune:tenant_a.dedup_marker", dedupactivity.PruneActivityName(inSchema))
	env.ExecuteWorkflow("DedupPrune", dedupactivity.PruneActivityName(other))
	require.True(t, env.IsWorkflowCompleted())
	require.NoError(t, env.GetWorkflowError())
	var res dedupactivity.PruneResult
	require.NoError(t, env.GetWorkflowResult(&res))
	require.Equal(t, int64(1), res.Deleted)
	require.Equal(t, int64(0), b.count(t, `SELECT count(*) FROM dedup_other`))
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM dedup_marker`), "the other table's run left this one")
}

// TestPruneStopsBeforeItsDeadline: the prune activity's run (PruneBy with
// the time it stops by) begins no batch, and reads no partition, past its
// stop, and says OutOfTime, the markers left for the next run; in time, it
// deletes them all and does not. Counted with SQL.
func TestPruneStopsBeforeItsDeadline(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("Batches", func(t *testing.T) {
		t.Parallel()
		b := setup(t, dedupactivity.Options{Retention: time.Minute})
		_, err := b.pool.Exec(ctx, `
INSERT INTO dedup_marker (id_hash, activity_type, attempt, expires_at)
SELECT sha256(int4send(g)), 'T', 1, now() - interval '1 hour' FROM generate_series(1, 2500) g`)
		require.NoError(t, err)
		res, err := dedupactivity.PruneBy(ctx, b.d, time.Now().Add(-time.Second))
		require.NoError(t, err)
		require.Equal(t, dedupactivity.PruneResult{OutOfTime: true}, res)
		require.Equal(t, int64(2500), b.markers(t), "left for the next run")
		res, err = dedupactivity.PruneBy(ctx, b.d, time.Now().Add(time.Hour))
		require.NoError(t, err)
		require.Equal(t, dedupactivity.PruneResult{Deleted: 2500}, res)
		require.Zero(t, b.markers(t))
	})
	t.Run("Partitions", func(t *testing.T) {
		t.Parallel()
		b, _ := expiredPartition(t)
		res, err := dedupactivity.PruneBy(ctx, b.d, time.Now().Add(-time.Second))
		require.NoError(t, err)
		require.Equal(t, dedupactivity.PruneResult{OutOfTime: true}, res)
		require.Equal(t, int64(1), b.markers(t), "its partition left for the next run")
		res, err = dedupactivity.PruneBy(ctx, b.d, time.Now().Add(time.Hour))
		require.NoError(t, err)
		require.Equal(t, dedupactivity.PruneResult{Deleted: 1}, res)
		require.Zero(t, b.markers(t))
	})
}

func TestPruneBatchesAndRetentionBound(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{Retention: time.Minute})
	ctx := context.Background()
	// 2,500 expired markers and 10 live ones.
	_, err := b.pool.Exec(ctx, `
INSERT INTO dedup_marker (id_hash, activity_type, attempt, expires_at)
SELECT sha256(int4send(g)), 'T', 1,
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
		"BoundedRetriesWithin":  {workflow.ActivityOptions{ScheduleToStartTimeout: time.Minute, StartToCloseTimeout: time.Minute, RetryPolicy: &temporal.RetryPolicy{MaximumAttempts: 5, MaximumInterval: time.Minute}}, false},
		"BoundedRetriesTooLong": {workflow.ActivityOptions{ScheduleToStartTimeout: time.Minute, StartToCloseTimeout: time.Hour, RetryPolicy: &temporal.RetryPolicy{MaximumAttempts: 1000, MaximumInterval: time.Hour}}, true},
		// Each attempt may wait in the task queue: without ScheduleToStart,
		// without bound; with it, that wait counts.
		"BoundedRetriesUnboundedQueueWait": {workflow.ActivityOptions{StartToCloseTimeout: time.Minute, RetryPolicy: &temporal.RetryPolicy{MaximumAttempts: 5, MaximumInterval: time.Minute}}, true},
		"BoundedRetriesLongQueueWait":      {workflow.ActivityOptions{ScheduleToStartTimeout: 8 * day, StartToCloseTimeout: time.Minute, RetryPolicy: &temporal.RetryPolicy{MaximumAttempts: 5, MaximumInterval: time.Minute}}, true},
		"ZeroAttemptsUnlimited":            {workflow.ActivityOptions{StartToCloseTimeout: time.Minute, RetryPolicy: &temporal.RetryPolicy{}}, true},
		// MaximumAttempts times an attempt's span is more than a
		// time.Duration holds (about 292 years): it must not wrap to a
		// negative bound, which is within any retention.
		"BoundedRetriesOverflow": {workflow.ActivityOptions{ScheduleToStartTimeout: day, StartToCloseTimeout: day, RetryPolicy: &temporal.RetryPolicy{MaximumAttempts: 100000, MaximumInterval: time.Hour}}, true},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			w := dedupactivity.RedeliveryWarning("Post", c.opts, dedupactivity.DefaultRetention)
			require.Equal(t, c.warn, w != "", w)
		})
	}
}

// TestReservedWordNames: any lower-case identifier works as Schema and
// Table, reserved words included, in both layouts.
func TestReservedWordNames(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	t.Cleanup(func() { _, _ = s.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS "select" CASCADE`) })
	for _, opts := range []dedupactivity.Options{
		{Table: "user"},
		{Schema: "select", Table: "order"},
		{Table: "table", PartitionInterval: time.Hour},
	} {
		d, err := dedupactivity.New(s.Pool, opts)
		require.NoError(t, err)
		require.NoError(t, d.Migrate(ctx), "%+v", opts)
		fn := dedupactivity.Wrap(d, func(ctx context.Context, tx pgx.Tx, in int) (int, error) { return in, nil })
		var suite testsuite.WorkflowTestSuite
		deliveries := 2
		if opts.PartitionInterval > 0 {
			deliveries = 1 // each test environment schedules at its own time: another event there
		}
		for range deliveries {
			env := suite.NewTestActivityEnvironment()
			env.RegisterActivityWithOptions(fn, activity.RegisterOptions{Name: "Post"})
			_, err := env.ExecuteActivity("Post", 1)
			require.NoError(t, err)
		}
		_, err = d.Prune(ctx)
		require.NoError(t, err)
		table := pgx.Identifier{opts.Table}
		if opts.Schema != "" {
			table = pgx.Identifier{opts.Schema, opts.Table}
		}
		var n int
		require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM `+table.Sanitize()).Scan(&n))
		require.Equal(t, 1, n, "%+v", opts)
	}
}

// TestMigrateBesideAForeignTableLaterInSearchPath: without Options.Schema,
// a table of the marker table's name further down search_path that is not a
// marker table is left alone: Migrate makes the marker table in
// current_schema(), where claims find it first.
func TestMigrateBesideAForeignTableLaterInSearchPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	first, later := pgtest.NewSchema(t), pgtest.NewSchema(t)
	_, err := later.Pool.Exec(ctx, `CREATE TABLE dedup_marker (id text PRIMARY KEY, created timestamptz)`)
	require.NoError(t, err)
	url, err := pgtest.WithSearchPath(pgtest.RequireServer(t).URL, first.Name+","+later.Name)
	require.NoError(t, err)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	_, outcome, err := dedupactivity.Do(ctx, d, runScoped("sp"), Transfer{}, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) {
		_, err := tx.Exec(ctx, `SELECT $1::int`, 1)
		return 1, err
	})
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	var markers int
	require.NoError(t, first.Pool.QueryRow(ctx, `SELECT count(*) FROM dedup_marker`).Scan(&markers))
	require.Equal(t, 1, markers, "the marker table made in the first schema")
}

// TestMigrateRefusesAForeignTableInAQuotedSchema: the foreign table is
// found in current_schema() also when that schema's name needs quoting
// (compared as a name, not parsed as an identifier).
func TestMigrateRefusesAForeignTableInAQuotedSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := pgtest.RequireServer(t)
	admin, err := pgx.Connect(ctx, srv.URL)
	require.NoError(t, err)
	defer admin.Close(ctx)
	schema := fmt.Sprintf("Tenant_%d", time.Now().UnixNano()) // upper case: quoted
	q := pgx.Identifier{schema}.Sanitize()
	_, err = admin.Exec(ctx, `CREATE SCHEMA `+q+`; CREATE TABLE `+q+`.dedup_marker (identity_hash bytea PRIMARY KEY, result bytea, expires_at timestamptz)`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DROP SCHEMA `+q+` CASCADE`) })
	u, err := pgtest.WithSearchPath(srv.URL, url.QueryEscape(q))
	require.NoError(t, err)
	pool, err := pgxpool.New(ctx, u)
	require.NoError(t, err)
	defer pool.Close()
	var current string
	require.NoError(t, pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&current))
	require.Equal(t, schema, current)
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)
	require.ErrorIs(t, d.Migrate(ctx), dedupactivity.ErrInvalidOptions)
}
