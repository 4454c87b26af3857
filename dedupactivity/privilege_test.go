package dedupactivity_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// TestLeastPrivilegeRole runs Migrate, claims, duplicates and pruning as a
// role that holds only the grants design.md's Security lists for the marker table
// (plus what the test's own effect needs), and shows it cannot create
// tables: Migrate on an up-to-date table only reads the catalog.
func TestLeastPrivilegeRole(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	pool := leastPrivilegePool(t, b, "rt_", `
-- the effect's own tables
GRANT SELECT, INSERT, UPDATE ON %[1]s.ledger, %[1]s.account TO %[2]s;
GRANT USAGE ON SEQUENCE %[1]s.ledger_id_seq TO %[2]s;`)

	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx), "an up-to-date table needs no CREATE")
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "k"}
	_, outcome, err := dedupactivity.Do(ctx, d, id, Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	_, outcome, err = dedupactivity.Do(ctx, d, id, Transfer{Account: "a", Amount: 1}, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	_, err = b.pool.Exec(ctx, `UPDATE dedup_marker SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	n, err := d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)

	_, err = pool.Exec(ctx, `CREATE TABLE nope (id int)`)
	require.Error(t, err, "the runtime role cannot create tables")
}

// TestLeastPrivilegeRolePartitionedLayout: in the partitioned layout, a
// role that may claim but does not own the table still migrates (an
// up-to-date table) when a partition ahead is missing: making partitions is
// left to the owner's pruner, and claims.
func TestLeastPrivilegeRolePartitionedLayout(t *testing.T) {
	t.Parallel()
	opts := dedupactivity.Options{PartitionInterval: time.Hour, Retention: time.Hour}
	b := setup(t, opts)
	ctx := context.Background()
	var last string
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT max(c.relname) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'dedup_marker'::regclass AND c.relname <> 'dedup_marker_default'`).Scan(&last))
	_, err := b.pool.Exec(ctx, `DROP TABLE `+last)
	require.NoError(t, err)
	pool := leastPrivilegePool(t, b, "rp_", `
GRANT SELECT, INSERT, UPDATE ON %[1]s.ledger, %[1]s.account TO %[2]s;
GRANT USAGE ON SEQUENCE %[1]s.ledger_id_seq TO %[2]s;`)
	d, err := dedupactivity.New(pool, opts)
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	require.NoError(t, b.d.Migrate(ctx), "the owner makes the missing partition")
	require.Equal(t, int64(1), b.tables(t, last))

	// A delivery claims through the parent table. (Each test environment
	// schedules its activity anew, so a second delivery here would be
	// another event in this layout, whose key holds the ScheduledTime.)
	_, err = deliver(t, "Post", dedupactivity.Wrap(d, b.post), Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(1), b.markers(t))
}

// leastPrivilegePool returns a pool of a new role (named prefix + the
// test's schema) with the grants docs/design.md's Security section lists
// for claiming, plus more (SQL with %[1]s for the schema, %[2]s for the
// role); the role is dropped after the test.
func leastPrivilegePool(t *testing.T, b *testBundle, prefix, more string) *pgxpool.Pool {
	t.Helper()
	return b.schema.RolePool(t, prefix+b.schema.Name, `
GRANT USAGE ON SCHEMA %[1]s TO %[2]s;
GRANT SELECT, INSERT, DELETE, UPDATE (result) ON %[1]s.dedup_marker TO %[2]s;`+more)
}

// TestRefusedConnection: a database that refuses the connection gives a
// clear, retryable error and no panic.
func TestRefusedConnection(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=2")
	require.NoError(t, err) // pgxpool connects lazily
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)
	fn := dedupactivity.Wrap(d, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) { return 1, nil })
	_, err = deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.ErrorContains(t, err, "acquire connection")
	require.ErrorContains(t, err, "connect")
}

// TestLeastPrivilegeOldestMarkerGaugePartitioned: the oldest-marker and
// overdue gauges of a least-privilege worker in the partitioned layout,
// whose role may read the marker table and not its default partition, are
// observed from the range partitions' bounds, at every collection.
func TestLeastPrivilegeOldestMarkerGaugePartitioned(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, Retention: time.Hour}
	b := setup(t, opts)
	ctx := context.Background()
	pool := leastPrivilegePool(t, b, "og_", ``)
	reader := sdkmetric.NewManualReader()
	opts.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	d, err := dedupactivity.New(pool, opts)
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	for range 2 {
		got := gaugeValues(t, reader, dedupactivity.MetricOldestMarkerAge)
		require.Len(t, got, 1, "observed")
		require.InDelta(t, time.Since(oldestPartitionStart(t, b, "dedup_marker")).Seconds(), got[0], 5, "the current partition's start")
		require.Equal(t, []float64{0}, gaugeValues(t, reader, dedupactivity.MetricOverdueMarkerAge), "none overdue")
	}
	lo := time.Now().Truncate(iv).Add(-10 * iv)
	_, err = b.pool.Exec(ctx, `CREATE TABLE `+partitionName(lo)+` PARTITION OF dedup_marker FOR VALUES FROM ('`+lo.UTC().Format(time.RFC3339)+`') TO ('`+lo.Add(iv).UTC().Format(time.RFC3339)+`')`)
	require.NoError(t, err)
	got := gaugeValues(t, reader, dedupactivity.MetricOverdueMarkerAge)
	require.Len(t, got, 1, "observed")
	require.InDelta(t, time.Since(lo.Add(iv+opts.Retention)).Seconds(), got[0], 5, "a past partition's end plus Retention, from the catalog")
}

// TestMigrateInASchemaADBAMade: a role that may create tables in an existing
// schema (USAGE and CREATE on it, as a DBA grants it) and not schemas (no
// CREATE on the database) migrates with Options.Schema naming it: Migrate
// does not ask for the schema it finds there. Before, its CREATE SCHEMA IF
// NOT EXISTS failed with "permission denied for database" (42501), which
// PostgreSQL checks before it looks for the schema.
func TestMigrateInASchemaADBAMade(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	schema := b.schema.Name + "_app"
	_, err := b.pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{schema}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = b.pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
	})
	pool := b.schema.RolePool(t, "so_"+b.schema.Name, `GRANT USAGE, CREATE ON SCHEMA `+pgx.Identifier{schema}.Sanitize()+` TO %[2]s;`)
	var mayCreateSchemas bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT has_database_privilege(current_database(), 'CREATE')`).Scan(&mayCreateSchemas))
	require.False(t, mayCreateSchemas)

	for _, opts := range []dedupactivity.Options{
		{Schema: schema},
		{Schema: schema, Table: "dedup_marker_p", PartitionInterval: time.Hour, Retention: time.Hour},
	} {
		d, err := dedupactivity.New(pool, opts)
		require.NoError(t, err)
		require.NoError(t, d.Migrate(ctx), "table %s", opts.Table)
	}
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "k"}
	d, err := dedupactivity.New(pool, dedupactivity.Options{Schema: schema})
	require.NoError(t, err)
	_, outcome, err := dedupactivity.Do(ctx, d, id, 1, func(context.Context, pgx.Tx, int) (int, error) { return 1, nil })
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
}
