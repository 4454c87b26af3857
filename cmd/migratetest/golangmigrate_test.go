package migratetest_test

import (
	"context"
	"database/sql"
	"errors"
	"io/fs"
	"testing"
	"time"

	"github.com/golang-migrate/migrate/v4"
	migratepgx "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx/v5"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/migrations"
	outboxmigrations "github.com/dedupactivity/dedupactivity/migrations/outbox"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// Entry is the test effect's input and result.
type Entry struct {
	Key string
	ID  int64
}

type testBundle struct {
	schema *pgtest.Schema
	m      *migrate.Migrate
}

// setup gives the test a schema with a ledger table, and golang-migrate
// reading dir of fsys with its pgx v5 driver, its version table
// (schema_migrations) in that schema.
func setup(t *testing.T, fsys fs.FS, dir string) *testBundle {
	t.Helper()
	s := pgtest.NewSchema(t)
	_, err := s.Pool.Exec(context.Background(), `CREATE TABLE ledger (id bigserial PRIMARY KEY, key text NOT NULL)`)
	require.NoError(t, err)

	src, err := iofs.New(fsys, dir)
	require.NoError(t, err)
	db, err := sql.Open("pgx/v5", s.URL) // search_path is the test's schema
	require.NoError(t, err)
	driver, err := migratepgx.WithInstance(db, &migratepgx.Config{})
	require.NoError(t, err)
	m, err := migrate.NewWithInstance("iofs", src, "pgx5", driver)
	require.NoError(t, err)
	t.Cleanup(func() {
		srcErr, dbErr := m.Close()
		require.NoError(t, errors.Join(srcErr, dbErr))
	})
	return &testBundle{schema: s, m: m}
}

// effect writes one ledger row.
func effect(ctx context.Context, tx pgx.Tx, key string) (Entry, error) {
	e := Entry{Key: key}
	err := tx.QueryRow(ctx, `INSERT INTO ledger (key) VALUES ($1) RETURNING id`, key).Scan(&e.ID)
	return e, err
}

func (b *testBundle) count(t *testing.T, query string, args ...any) int64 {
	t.Helper()
	var n int64
	require.NoError(t, b.schema.Pool.QueryRow(context.Background(), query, args...).Scan(&n))
	return n
}

// exists says whether the relation exists in the test's schema.
func (b *testBundle) exists(t *testing.T, name string) bool {
	t.Helper()
	var ok bool
	require.NoError(t, b.schema.Pool.QueryRow(context.Background(), `SELECT to_regclass($1) IS NOT NULL`,
		pgx.Identifier{b.schema.Name, name}.Sanitize()).Scan(&ok))
	return ok
}

// requireVersion checks the version golang-migrate recorded: want 0 is none.
func (b *testBundle) requireVersion(t *testing.T, want uint) {
	t.Helper()
	v, dirty, err := b.m.Version()
	if want == 0 {
		require.ErrorIs(t, err, migrate.ErrNilVersion)
		return
	}
	require.NoError(t, err)
	require.False(t, dirty)
	require.Equal(t, want, v)
}

// TestGolangMigrateDefaultLayout: golang-migrate applies migrations.FS as it
// is; Deduper.Migrate then finds nothing to do and claims work. After
// golang-migrate's Down, Deduper.Migrate makes the table again, and
// golang-migrate's Up runs again over it (the files are idempotent).
func TestGolangMigrateDefaultLayout(t *testing.T) {
	t.Parallel()
	b := setup(t, migrations.FS, ".")
	ctx := context.Background()
	d, err := dedupactivity.New(b.schema.Pool, dedupactivity.Options{})
	require.NoError(t, err)

	// claims delivers the event of key twice and checks that the first
	// delivery claimed it and the second was a duplicate returning its
	// result; then, by SQL, that the effect ran once more (the ledger holds
	// wantLedger rows of key) and the marker is there.
	claims := func(t *testing.T, key string, wantLedger int64) {
		t.Helper()
		id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Record", Key: key}
		first, outcome, err := dedupactivity.Do(ctx, d, id, key, effect)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
		dup, outcome, err := dedupactivity.Do(ctx, d, id, key, effect)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
		require.Equal(t, first, dup)
		require.Equal(t, wantLedger, b.count(t, `SELECT count(*) FROM ledger WHERE key = $1`, key))
		require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM dedup_marker WHERE id_hash = $1`, func() []byte { h := id.Hash(); return h[:] }()))
	}

	require.NoError(t, b.m.Up())
	b.requireVersion(t, 1)
	require.True(t, b.exists(t, "dedup_marker"))
	require.NoError(t, d.Migrate(ctx))
	require.False(t, b.exists(t, "dedup_marker_migration"), "Deduper.Migrate applied nothing (it records what it applies)")
	claims(t, "after-up", 1)

	require.NoError(t, b.m.Down())
	b.requireVersion(t, 0)
	require.False(t, b.exists(t, "dedup_marker"), "golang-migrate's Down dropped the table")

	require.NoError(t, d.Migrate(ctx))
	require.True(t, b.exists(t, "dedup_marker"))
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM dedup_marker_migration WHERE version = 1`), "Deduper.Migrate applied 001")
	claims(t, "after-down", 1)
	claims(t, "after-up", 2) // its marker went with the table: applied again

	// Up again over the table Deduper.Migrate made: nothing changes.
	require.NoError(t, b.m.Up())
	b.requireVersion(t, 1)
	require.Equal(t, int64(2), b.count(t, `SELECT count(*) FROM dedup_marker`))
	claims(t, "after-up-again", 1)
}

// TestGolangMigratePartitionedLayout: the same with migrations.PartitionedFS
// under partitioned/, the layout of Options.PartitionInterval; claims are
// run-scoped (the layout refuses business keys), through Wrap in a test
// activity environment.
func TestGolangMigratePartitionedLayout(t *testing.T) {
	t.Parallel()
	b := setup(t, migrations.PartitionedFS, "partitioned")
	ctx := context.Background()
	d, err := dedupactivity.New(b.schema.Pool, dedupactivity.Options{PartitionInterval: time.Hour})
	require.NoError(t, err)

	// claim delivers a new event (every test activity environment has a new
	// ScheduledTime) and checks, by SQL, that its effect and marker
	// committed, the marker in a partition made ahead.
	claim := func(t *testing.T, key string) {
		t.Helper()
		var s testsuite.WorkflowTestSuite
		env := s.NewTestActivityEnvironment()
		env.RegisterActivityWithOptions(dedupactivity.Wrap(d, effect), activity.RegisterOptions{Name: "Record"})
		val, err := env.ExecuteActivity("Record", key)
		require.NoError(t, err)
		var e Entry
		require.NoError(t, val.Get(&e))
		require.Equal(t, key, e.Key)
		require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM ledger WHERE key = $1 AND id = $2`, key, e.ID))
		var part string
		require.NoError(t, b.schema.Pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM dedup_marker ORDER BY claimed_at DESC LIMIT 1`).Scan(&part))
		require.NotEqual(t, "dedup_marker_default", part)
	}
	partitioned := func() bool {
		var kind string
		require.NoError(t, b.schema.Pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = to_regclass('dedup_marker')`).Scan(&kind))
		return kind == "p"
	}

	require.NoError(t, b.m.Up())
	b.requireVersion(t, 1)
	require.True(t, partitioned())
	require.NoError(t, d.Migrate(ctx))
	require.False(t, b.exists(t, "dedup_marker_migration"), "Deduper.Migrate applied nothing (it records what it applies)")
	claim(t, "after-up")
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM dedup_marker`))

	require.NoError(t, b.m.Down())
	b.requireVersion(t, 0)
	require.False(t, b.exists(t, "dedup_marker"))
	require.False(t, b.exists(t, "dedup_marker_default"))

	require.NoError(t, d.Migrate(ctx))
	require.True(t, partitioned())
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM dedup_marker_migration WHERE version = 1`), "Deduper.Migrate applied 001")
	claim(t, "after-down")
	require.NoError(t, b.m.Up())
	b.requireVersion(t, 1)
	claim(t, "after-up-again")
	require.Equal(t, int64(2), b.count(t, `SELECT count(*) FROM dedup_marker`))
	require.Equal(t, int64(3), b.count(t, `SELECT count(*) FROM ledger`))
}

// TestGolangMigrateOutbox: golang-migrate applies the outbox's files as they
// are, and Outbox.Migrate (which a worker runs at every start) then records
// its versions. After golang-migrate's Down, Outbox.Migrate makes the table
// again, as Deduper.Migrate does for the marker table: the down files drop
// its record of versions with the table.
func TestGolangMigrateOutbox(t *testing.T) {
	t.Parallel()
	b := setup(t, outboxmigrations.FS, ".")
	ctx := context.Background()
	ob, err := outbox.New(b.schema.Pool, outbox.Options{})
	require.NoError(t, err)

	require.NoError(t, b.m.Up())
	b.requireVersion(t, 1)
	require.NoError(t, ob.Migrate(ctx))
	require.True(t, b.exists(t, "dedup_outbox"))

	require.NoError(t, b.m.Down())
	b.requireVersion(t, 0)
	require.False(t, b.exists(t, "dedup_outbox"), "golang-migrate's Down dropped the table")

	require.NoError(t, ob.Migrate(ctx))
	require.True(t, b.exists(t, "dedup_outbox"), "Outbox.Migrate made the table again")
	_, err = ob.Stats(ctx)
	require.NoError(t, err)

	// Up again over the table Outbox.Migrate made: nothing changes.
	require.NoError(t, b.m.Up())
	b.requireVersion(t, 1)
}

// TestGolangMigrateMarkerAndOutboxInOneSchema: the marker's and the
// outbox's files are numbered from 001 each, so golang-migrate applies both
// sets to one schema only with a migrations table for each
// (pgx5.Config.MigrationsTable, or x-migrations-table in a URL): sharing
// schema_migrations, the outbox's set finds its version 1 applied (the
// marker's) and makes no table, reporting only that nothing changed.
// Doc-only (passes before and after): docs/pgbouncer.md says so.
func TestGolangMigrateMarkerAndOutboxInOneSchema(t *testing.T) {
	t.Parallel()
	b := setup(t, migrations.FS, ".")
	require.NoError(t, b.m.Up())

	outboxMigrate := func(cfg *migratepgx.Config) *migrate.Migrate {
		src, err := iofs.New(outboxmigrations.FS, ".")
		require.NoError(t, err)
		db, err := sql.Open("pgx/v5", b.schema.URL)
		require.NoError(t, err)
		driver, err := migratepgx.WithInstance(db, cfg)
		require.NoError(t, err)
		m, err := migrate.NewWithInstance("iofs", src, "pgx5", driver)
		require.NoError(t, err)
		t.Cleanup(func() { _, _ = m.Close() })
		return m
	}
	require.ErrorIs(t, outboxMigrate(&migratepgx.Config{}).Up(), migrate.ErrNoChange, "one schema_migrations for both sets")
	require.False(t, b.exists(t, "dedup_outbox"), "and no outbox table")
	b.requireVersion(t, 1)

	m := outboxMigrate(&migratepgx.Config{MigrationsTable: "dedup_outbox_schema_migrations"})
	require.NoError(t, m.Up())
	require.True(t, b.exists(t, "dedup_outbox"))
	require.True(t, b.exists(t, "dedup_marker"))
	v, dirty, err := m.Version()
	require.NoError(t, err)
	require.False(t, dirty)
	require.EqualValues(t, 1, v)
	b.requireVersion(t, 1)
}
