package dedupactivity_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
)

func TestPartitionedLayout(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{PartitionInterval: 2 * time.Second, PartitionsAhead: 2, Retention: time.Minute})
	ctx := context.Background()
	partitions := func() []string {
		rows, err := b.pool.Query(ctx, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
			WHERE i.inhparent = 'dedup_marker'::regclass ORDER BY 1`)
		require.NoError(t, err)
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return names
	}
	require.Len(t, partitions(), 4, "the current interval, 2 ahead, and the default partition")

	fn := dedupactivity.Wrap(b.d, b.post)
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	part := markerPartition(t, b)
	require.NotEqual(t, "dedup_marker_default", part, "the marker sits in its scheduled time's partition")

	// Unexpired: the partition outlives its range, and Prune passes it over
	// without taking its lock (which would block claims): a reader holding
	// the partition is not waited for.
	time.Sleep(2100 * time.Millisecond)
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = holder.Exec(ctx, `LOCK TABLE `+part+` IN ACCESS SHARE MODE`)
	require.NoError(t, err)
	var waited atomic.Bool
	stop, watched := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(watched)
		for {
			select {
			case <-stop:
				return
			default:
			}
			var n int
			if b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = $1::regclass`, part).Scan(&n) == nil && n > 0 {
				waited.Store(true)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	_, err = b.d.Prune(ctx)
	close(stop)
	<-watched
	require.NoError(t, holder.Rollback(ctx))
	require.NoError(t, err)
	require.False(t, waited.Load(), "Prune waited for the lock of a partition still in its retention")
	require.Contains(t, partitions(), part)
	require.Equal(t, int64(1), b.markers(t))

	// Expired: the partition is dropped, new ones are made ahead.
	_, err = b.pool.Exec(ctx, `UPDATE dedup_marker SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	before := time.Now().Unix()
	n, err := b.d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.NotContains(t, partitions(), part)
	require.Zero(t, b.markers(t))
	// Partitions are made 2 intervals ahead of the Prune (counting them
	// instead failed once in a fresh-clone CI run: under load the current
	// 2s interval ended between Prune's steps, and its empty partition was
	// dropped as over, rightly), and a delivery now finds its interval's.
	var newest int64
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT max(extract(epoch FROM substring(pg_get_expr(c.relpartbound, 0) FROM $$FROM \('([^']+)'\)$$)::timestamptz))::bigint
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'dedup_marker'::regclass`).Scan(&newest))
	require.GreaterOrEqual(t, newest, before-before%2+4, "the newest partition starts 2 intervals past the Prune's")
	_, err = deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	require.NotEqual(t, "dedup_marker_default", markerPartition(t, b))

	// Identities whose deliveries do not share a ScheduledTime are refused.
	require.Panics(t, func() {
		dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return in.Account, nil }))
	}, "refused when wrapping")

	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestActivityEnvironment()
	env.RegisterActivityWithOptions(fn, activity.RegisterOptions{Name: "Post"})
	_, err = env.ExecuteLocalActivity(fn, Transfer{Account: "a", Amount: 1})
	require.ErrorContains(t, err, "partitioned layout")

	// Partition bounds are read back to the second.
	_, err = dedupactivity.New(b.pool, dedupactivity.Options{PartitionInterval: 1500 * time.Millisecond})
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	require.ErrorContains(t, err, "whole number of seconds")

	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "k"}
	_, _, err = dedupactivity.Do(ctx, b.d, id, Transfer{Account: "a", Amount: 1}, b.post)
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	require.Equal(t, int64(2), b.ledgerRows(t), "nothing refused wrote anything")
}

// TestMigrateRefusesTheOtherLayout: Options whose layout is not the
// table's fail at Migrate, before any delivery, in both directions.
func TestMigrateRefusesTheOtherLayout(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	partitioned := dedupactivity.Options{PartitionInterval: time.Hour, Retention: time.Hour}
	cases := map[string]struct{ made, used dedupactivity.Options }{
		"PartitionedTableDefaultOptions": {partitioned, dedupactivity.Options{}},
		"DefaultTablePartitionedOptions": {dedupactivity.Options{}, partitioned},
	}
	for name, c := range cases {
		c.made.Table, c.used.Table = strings.ToLower(name), strings.ToLower(name)
		made, err := dedupactivity.New(b.pool, c.made)
		require.NoError(t, err, name)
		require.NoError(t, made.Migrate(ctx), name)
		used, err := dedupactivity.New(b.pool, c.used)
		require.NoError(t, err, name)
		err = used.Migrate(ctx)
		require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions, name)
		require.ErrorContains(t, err, "layout", name)
		require.NoError(t, made.Migrate(ctx), "%s: the table's own layout still migrates", name)
	}

	// Partitions of another interval are in the way: a clear refusal, not
	// an overlap error at every Migrate and Prune.
	made, err := dedupactivity.New(b.pool, dedupactivity.Options{Table: "hourly", PartitionInterval: time.Hour, Retention: time.Hour})
	require.NoError(t, err)
	require.NoError(t, made.Migrate(ctx))
	// Read through a session whose DateStyle and TimeZone are not the
	// creator's: the bounds are read back from their text.
	cfg, err := pgxpool.ParseConfig(b.schema.URL)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["DateStyle"] = "SQL, DMY"
	cfg.ConnConfig.RuntimeParams["TimeZone"] = "Asia/Kolkata"
	odd, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer odd.Close()
	for _, iv := range []time.Duration{30 * time.Minute, 2 * time.Hour, 24 * time.Hour} {
		used, err := dedupactivity.New(odd, dedupactivity.Options{Table: "hourly", PartitionInterval: iv, Retention: 24 * time.Hour})
		require.NoError(t, err)
		err = used.Migrate(ctx)
		require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions, iv)
		require.ErrorContains(t, err, "PartitionInterval", iv)
	}
	// A coarser interval that lines up with the table's finds names it
	// expects and overlaps nothing: refused all the same.
	half, err := dedupactivity.New(b.pool, dedupactivity.Options{Table: "halfhourly", PartitionInterval: 30 * time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	require.NoError(t, half.Migrate(ctx))
	coarse, err := dedupactivity.New(odd, dedupactivity.Options{Table: "halfhourly", PartitionInterval: time.Hour, Retention: time.Hour})
	require.NoError(t, err)
	require.ErrorIs(t, coarse.Migrate(ctx), dedupactivity.ErrInvalidOptions)

	same, err := dedupactivity.New(odd, dedupactivity.Options{Table: "hourly", PartitionInterval: time.Hour, Retention: time.Hour})
	require.NoError(t, err)
	require.NoError(t, same.Migrate(ctx), "the table's own interval, read in another DateStyle and TimeZone")
	_, err = same.Prune(ctx)
	require.NoError(t, err)
}

// TestRangeLeftInTheDefaultPartition: when maintenance fell behind and
// markers of a range went to the default partition, Prune leaves the range
// there without trying to create its partition (which fails on those rows,
// after reading the default partition under the table lock): no statement
// fails. The ranges ahead are still made.
func TestRangeLeftInTheDefaultPartition(t *testing.T) {
	t.Parallel()
	opts := dedupactivity.Options{PartitionInterval: 24 * time.Hour, PartitionsAhead: 1}
	b := setup(t, opts)
	ctx := context.Background()
	today := "dedup_marker_p" + strconv.FormatInt(time.Now().Truncate(24*time.Hour).Unix(), 10)
	dropPartition(t, b, today)
	_, err := deliver(t, "Post", dedupactivity.Wrap(b.d, b.post), Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	inDefault := func() int64 {
		return b.count(t, `SELECT count(*) FROM dedup_marker WHERE tableoid = 'dedup_marker_default'::regclass`)
	}
	require.Equal(t, int64(1), inDefault(), "the marker went to the default partition")

	pool, tracer := tracingPool(t, b.schema.URL)
	d, err := dedupactivity.New(pool, opts)
	require.NoError(t, err)
	_, err = d.Prune(ctx)
	require.NoError(t, err)
	tracer.mu.Lock()
	require.Empty(t, tracer.errors, "no statement failed")
	tracer.mu.Unlock()
	require.Zero(t, b.tables(t, today), "the range stays in the default partition")
	require.Equal(t, int64(1), inDefault())
	tomorrow := "dedup_marker_p" + strconv.FormatInt(time.Now().Truncate(24*time.Hour).Add(24*time.Hour).Unix(), 10)
	require.Equal(t, int64(1), b.tables(t, tomorrow), "the range ahead is made")
}

// markerPartition is the partition that holds b's one marker.
func markerPartition(t *testing.T, b *testBundle) string {
	t.Helper()
	var part string
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT tableoid::regclass::text FROM dedup_marker`).Scan(&part))
	return part
}

// expiredPartition sets up the partitioned layout, in partitions of 2s,
// with one marker whose partition's range is over and which has expired:
// the next Prune drops that partition.
func expiredPartition(t *testing.T) (*testBundle, dedupactivity.Options) {
	t.Helper()
	opts := dedupactivity.Options{PartitionInterval: 2 * time.Second, PartitionsAhead: 1, Retention: time.Minute}
	b := setup(t, opts)
	_, err := deliver(t, "Post", dedupactivity.Wrap(b.d, b.post), Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	require.Eventually(t, func() bool { // the marker's partition's range is over
		return b.count(t, `SELECT count(*) FROM dedup_marker WHERE scheduled_at < now() - interval '2 seconds'`) == 1
	}, 10*time.Second, 100*time.Millisecond)
	_, err = b.pool.Exec(context.Background(), `UPDATE dedup_marker SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	return b, opts
}

// TestPartitionDroppedWhileAPrunerWaitsToLockIt: a pruner that read a
// partition as expired, then waited for the partition's lock while another
// transaction detached and dropped it, passes over it.
func TestPartitionDroppedWhileAPrunerWaitsToLockIt(t *testing.T) {
	t.Parallel()
	b, _ := expiredPartition(t)
	ctx := context.Background()
	part := markerPartition(t, b)

	// A claim's lock on the partition (ROW EXCLUSIVE): the pruner reads the
	// partition, then waits to lock it against writes.
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `LOCK TABLE `+part+` IN ROW EXCLUSIVE MODE`)
	require.NoError(t, err)
	type pruned struct {
		n   int64
		err error
	}
	done := make(chan pruned, 1)
	go func() {
		n, err := b.d.Prune(ctx)
		done <- pruned{n, err}
	}()
	require.Eventually(t, func() bool {
		// This schema's partition (the cluster's other tests have
		// partitions of the same names in theirs).
		return b.count(t, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = $1::regclass AND mode = 'ExclusiveLock'`, part) == 1
	}, 5*time.Second, 5*time.Millisecond, "the pruner waits to lock the partition")
	_, err = tx.Exec(ctx, `ALTER TABLE dedup_marker DETACH PARTITION `+part)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `DROP TABLE `+part)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	got := <-done
	require.NoError(t, got.err, "the pruner passes over the partition dropped meanwhile")
	require.Zero(t, got.n)
	require.Zero(t, b.markers(t))
}

// TestTwoPrunersAtOnce: a pruner that finds a partition dropped by another
// since it listed them passes over it, instead of failing with
// ErrNotMigrated (the table it was to read is gone).
func TestTwoPrunersAtOnce(t *testing.T) {
	t.Parallel()
	b, opts := expiredPartition(t)
	ctx := context.Background()
	other, err := dedupactivity.New(b.pool, opts)
	require.NoError(t, err)
	var aDeleted int64
	var aErr error
	ran := false
	deleted, err := dedupactivity.PruneWithProgress(ctx, b.d, func(int64) {
		if !ran { // between this pruner's list and its read of the partition
			ran = true
			aDeleted, aErr = other.Prune(ctx)
		}
	})
	require.True(t, ran)
	require.NoError(t, aErr)
	require.Equal(t, int64(1), aDeleted, "the other pruner dropped the partition")
	require.NoError(t, err, "this one passes over it")
	require.Zero(t, deleted)
	require.Zero(t, b.markers(t))
}

// TestPruneReportsAStrayTableOfAPartitionsName: a table with the name of a
// partition ahead that is not attached (detached by hand, say) fails Prune
// with an error that names it, instead of being taken for a partition
// another worker made at each run while the range's markers go to the
// default partition.
func TestPruneReportsAStrayTableOfAPartitionsName(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	b := setup(t, dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 3})
	ctx := context.Background()
	lo := time.Now().Truncate(iv).Add(2 * iv)
	stray := partitionName(lo)
	_, err := b.pool.Exec(ctx, `ALTER TABLE dedup_marker DETACH PARTITION `+stray)
	require.NoError(t, err)

	_, err = b.d.Prune(ctx)
	require.ErrorContains(t, err, stray)
	require.ErrorContains(t, err, "not a partition")
	require.Zero(t, b.count(t, `SELECT count(*) FROM pg_inherits WHERE inhrelid = $1::regclass`, stray), "left as it is")

	// Dropped, the next run makes the partition.
	_, err = b.pool.Exec(ctx, `DROP TABLE `+stray)
	require.NoError(t, err)
	_, err = b.d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM pg_inherits WHERE inhrelid = $1::regclass`, stray))
}

// partitionName is the name of the marker table's partition whose range
// starts at lo.
func partitionName(lo time.Time) string { return "dedup_marker_p" + strconv.FormatInt(lo.Unix(), 10) }

// tables counts the tables (0 or 1) named name in the test's schema.
func (b *testBundle) tables(t *testing.T, name string) int64 {
	t.Helper()
	return b.count(t, `SELECT count(*) FROM pg_class WHERE relname = $1 AND relnamespace = current_schema()::regnamespace`, name)
}

// dropPartition detaches and drops the marker table's partition name, as if
// it had never been made.
func dropPartition(t *testing.T, b *testBundle, name string) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), `ALTER TABLE dedup_marker DETACH PARTITION `+name+`; DROP TABLE `+name)
	require.NoError(t, err)
}

// TestPartitionMadeAheadBesideALongClaim: a claim transaction that stays
// open (a slow effect, here one that claimed first: a retry's) does not
// keep Prune from making a partition ahead: it is attached, under a lock
// on the table that claims do not conflict with. CREATE TABLE ... PARTITION
// OF waited for the claim, held up every claim behind it, and gave up at
// its lock timeout. (A first attempt's look: see
// TestPartitionMadeAheadBesideALongFirstAttempt.)
func TestPartitionMadeAheadBesideALongClaim(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	b := setup(t, dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 2})
	ctx := context.Background()
	ahead := partitionName(time.Now().Truncate(iv).Add(2 * iv)) // at least an hour ahead
	dropPartition(t, b, ahead)

	long, err := b.pool.Begin(ctx) // a claim whose effect still runs
	require.NoError(t, err)
	defer func() { _ = long.Rollback(ctx) }()
	_, err = long.Exec(ctx, `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type)
		VALUES ('\x01', now(), 1, now() + interval '1 hour', 'T')`)
	require.NoError(t, err)

	_, err = b.d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE c.relname = $1 AND i.inhparent = 'dedup_marker'::regclass`, ahead),
		"the partition ahead is made and attached while the claim runs")
	require.NoError(t, long.Commit(ctx))
	// Attached, it takes its range's markers and the primary key's
	// uniqueness: a second marker of one event is refused there.
	_, err = b.pool.Exec(ctx, `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type)
		VALUES ('\x02', $1, 1, now(), 'T'), ('\x02', $1, 2, now(), 'T')`, time.Now().Truncate(iv).Add(2*iv+time.Minute))
	require.Equal(t, "23505", sqlStateOf(err), "%v", err)
}

// lockSpy records, when the drop's check of a partition starts, whether
// the pruner's transaction holds a lock on the marker table itself.
type lockSpy struct {
	pool *pgxpool.Pool // another connection, to read pg_locks
	mu   sync.Mutex
	held []bool // one per check
}

func (s *lockSpy) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if !strings.HasPrefix(d.SQL, "SELECT count(*)") {
		return ctx
	}
	var held bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $1 AND granted AND relation = 'dedup_marker'::regclass AND mode <> 'AccessShareLock')`,
		conn.PgConn().PID()).Scan(&held)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.held = append(s.held, held || err != nil)
	return ctx
}

func (s *lockSpy) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestDropChecksThePartitionWithoutTheTableLock: the check of an expired
// partition, which reads all its rows, holds the partition's lock only; the
// table's lock, which every claim waits for, is taken for the detach, after
// it. Detached first, the partition was read while every claim waited.
func TestDropChecksThePartitionWithoutTheTableLock(t *testing.T) {
	t.Parallel()
	b, opts := expiredPartition(t)
	ctx := context.Background()
	spy := &lockSpy{pool: b.pool}
	pool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = spy })
	d, err := dedupactivity.New(pool, opts)
	require.NoError(t, err)
	n, err := d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "the partition is dropped")
	spy.mu.Lock()
	defer spy.mu.Unlock()
	// Each past partition is checked (under load, a 2s partition made
	// empty by Migrate may be past too), none with the table's lock.
	require.NotEmpty(t, spy.held, "checked")
	require.NotContains(t, spy.held, true, "a check ran with the table's lock")
}

// TestPruneGoesOnPastAPartitionItCannotRead: a past partition Prune cannot
// read (here, another transaction holds its lock past the role's
// statement_timeout; in production, a partition too large to read within
// it) fails that partition alone: the partitions ahead are made, the
// default partition is pruned, and the error is returned.
func TestPruneGoesOnPastAPartitionItCannotRead(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 2, Retention: time.Minute}
	b := setup(t, opts)
	ctx := context.Background()
	now := time.Now().Truncate(iv)
	past := now.Add(-48 * iv)
	_, err := b.pool.Exec(ctx, `CREATE TABLE `+partitionName(past)+` PARTITION OF dedup_marker FOR VALUES FROM ('`+past.UTC().Format(time.RFC3339)+`') TO ('`+past.Add(iv).UTC().Format(time.RFC3339)+`')`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type) VALUES
		('\x01', $1, 1, now() - interval '1 hour', 'T'), ('\x02', $2, 1, now() - interval '1 hour', 'T')`,
		past.Add(time.Minute), now.Add(-1000*iv)) // the second to the default partition
	require.NoError(t, err)
	ahead := partitionName(now.Add(2 * iv))
	dropPartition(t, b, ahead)

	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `LOCK TABLE `+partitionName(past)+` IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	pool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["statement_timeout"] = "300" })
	d, err := dedupactivity.New(pool, opts)
	require.NoError(t, err)
	n, err := d.Prune(ctx)
	require.ErrorContains(t, err, "read partition "+partitionName(past))
	require.Equal(t, "57014", sqlStateOf(err), "%v", err)
	require.Equal(t, int64(1), n, "the default partition's expired marker")
	require.Equal(t, int64(1), b.tables(t, ahead), "the partition ahead is made")
	require.Zero(t, b.count(t, `SELECT count(*) FROM dedup_marker_default`))
}

// TestOldestMarkerAgeOfPartitions: in the partitioned layout the
// oldest-marker gauge is read from the catalog and the default partition's
// expiry index: the oldest range partition's start, or the default
// partition's oldest marker if older. It reads no range partition, whose
// rows have no expiry index: one held by another transaction's lock does
// not keep it from being observed.
func TestOldestMarkerAgeOfPartitions(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	opts := dedupactivity.Options{Table: "parted", PartitionInterval: iv, PartitionsAhead: 1, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}
	d, err := dedupactivity.New(b.pool, opts)
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	age := func() []float64 { return gaugeValues(t, reader, dedupactivity.MetricOldestMarkerAge) }
	current := oldestPartitionStart(t, b, "parted")
	got := age()
	require.Len(t, got, 1)
	require.InDelta(t, time.Since(current).Seconds(), got[0], 5, "the current partition's start")

	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `LOCK TABLE parted_p`+strconv.FormatInt(current.Unix(), 10)+` IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `INSERT INTO parted (id_hash, scheduled_at, attempt, claimed_at, expires_at, activity_type)
		VALUES ('\x01', now() - interval '30 days', 1, now() - interval '10 days', now(), 'T')`) // to the default partition
	require.NoError(t, err)
	got = age()
	require.Len(t, got, 1, "observed while a range partition is locked")
	require.InDelta(t, (10 * 24 * time.Hour).Seconds(), got[0], 5, "the default partition's oldest marker")
}

// TestOverdueMarkersOfPartitions: in the partitioned layout the overdue
// gauge is how long ago the default partition's first marker expired, or
// the oldest range partition's end plus Retention passed, whichever is
// longer; 0 once Prune has dropped and deleted what was due.
func TestOverdueMarkersOfPartitions(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	opts := dedupactivity.Options{Table: "parted", PartitionInterval: iv, PartitionsAhead: 1, Retention: time.Hour,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}
	d, err := dedupactivity.New(b.pool, opts)
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	overdue := func() []float64 { return gaugeValues(t, reader, dedupactivity.MetricOverdueMarkerAge) }
	require.Equal(t, []float64{0}, overdue(), "the current partition and the one ahead")

	_, err = b.pool.Exec(ctx, `INSERT INTO parted (id_hash, scheduled_at, attempt, expires_at, activity_type)
		VALUES ('\x01', now() - interval '30 days', 1, now() - interval '2 hours', 'T')`) // to the default partition
	require.NoError(t, err)
	got := overdue()
	require.Len(t, got, 1)
	require.InDelta(t, (2 * time.Hour).Seconds(), got[0], 5, "the default partition's marker")

	lo := time.Now().Truncate(iv).Add(-10 * iv)
	_, err = b.pool.Exec(ctx, `CREATE TABLE parted_p`+strconv.FormatInt(lo.Unix(), 10)+` PARTITION OF parted FOR VALUES FROM ('`+lo.UTC().Format(time.RFC3339)+`') TO ('`+lo.Add(iv).UTC().Format(time.RFC3339)+`')`)
	require.NoError(t, err)
	got = overdue()
	require.Len(t, got, 1)
	require.InDelta(t, time.Since(lo.Add(iv+opts.Retention)).Seconds(), got[0], 5, "a past partition's end plus Retention")

	n, err := d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, []float64{0}, overdue(), "pruned")
}

// TestPartitionAheadMadeByAnotherWorkerMeanwhile: a pruner that finds
// another worker making the same partition ahead waits for it, then passes
// over the partition it made. Without the attach's lock on the table
// first, its CREATE TABLE failed on the other's catalog row (23505).
func TestPartitionAheadMadeByAnotherWorkerMeanwhile(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	b := setup(t, dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 3})
	ctx := context.Background()
	lo := time.Now().Truncate(iv).Add(2 * iv)
	ahead := partitionName(lo)
	dropPartition(t, b, ahead)

	other, err := b.pool.Begin(ctx) // the other worker, between its statements
	require.NoError(t, err)
	defer func() { _ = other.Rollback(ctx) }()
	_, err = other.Exec(ctx, `LOCK TABLE ONLY dedup_marker IN SHARE UPDATE EXCLUSIVE MODE`)
	require.NoError(t, err)
	_, err = other.Exec(ctx, `CREATE TABLE `+ahead+` (LIKE dedup_marker INCLUDING DEFAULTS) WITH (fillfactor = 80)`)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { _, err := b.d.Prune(ctx); done <- err }()
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'dedup_marker'::regclass AND mode = 'ShareUpdateExclusiveLock'`) == 1
	}, 5*time.Second, 5*time.Millisecond, "the pruner waits for the other worker")
	_, err = other.Exec(ctx, `ALTER TABLE dedup_marker ATTACH PARTITION `+ahead+` FOR VALUES FROM ('`+lo.UTC().Format(time.RFC3339)+`') TO ('`+lo.Add(iv).UTC().Format(time.RFC3339)+`')`)
	require.NoError(t, err)
	require.NoError(t, other.Commit(ctx))
	require.NoError(t, <-done, "another worker made it")

	// Workers starting together, each making the partitions ahead.
	for round := range 5 {
		for i := 2; i <= 3; i++ {
			name := partitionName(time.Now().Truncate(iv).Add(time.Duration(i) * iv))
			dropPartition(t, b, name)
		}
		errs := make(chan error, 4)
		for range cap(errs) {
			d, err := dedupactivity.New(b.pool, dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 3})
			require.NoError(t, err)
			go func() { errs <- d.Migrate(ctx) }()
		}
		for range cap(errs) {
			require.NoError(t, <-errs, "round %d", round)
		}
	}
}

// TestMigrateBesideAClaimHoldingAPartitionsLock: a worker that starts while
// a claim holds the lock the next partition needs (here, a claim routed to
// the default partition, which the attach locks) starts, and leaves the
// partition to Prune.
func TestMigrateBesideAClaimHoldingAPartitionsLock(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 2}
	b := setup(t, opts)
	ctx := context.Background()
	next := partitionName(time.Now().Truncate(iv).Add(iv))
	dropPartition(t, b, next)
	long, err := b.pool.Begin(ctx) // a claim whose marker went to the default partition, its effect running
	require.NoError(t, err)
	defer func() { _ = long.Rollback(ctx) }()
	_, err = long.Exec(ctx, `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type)
		VALUES ('\x01', now() - interval '1000 hours', 1, now() + interval '1 hour', 'T')`)
	require.NoError(t, err)
	d, err := dedupactivity.New(b.pool, opts)
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	_, err = d.Prune(ctx)
	require.ErrorContains(t, err, "create partition "+next, "Prune says it could not make the next partition")
	require.Equal(t, "55P03", sqlStateOf(err))
}

// countHook calls fn when the pruner's check of the partition *part starts,
// holding the partition's lock.
type countHook struct {
	part *string
	fn   func()
}

func (h countHook) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "SELECT count(*)") && strings.Contains(d.SQL, *h.part) {
		h.fn()
	}
	return ctx
}

func (countHook) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestDropBesideARetrysResultUpdate: a retry's claim (which claims first
// and stores its result with an UPDATE) of the current range, made while a
// pruner checks an expired partition under its lock, does not wait for it,
// even with generic plans: the update is planned for its parameters, so it
// locks its marker's partition alone. A generic plan locked every
// partition: the claim waited for the check while holding the table's lock,
// which the pruner's detach then waited for until its lock timeout, and the
// partition stayed.
func TestDropBesideARetrysResultUpdate(t *testing.T) {
	t.Parallel()
	b, opts := expiredPartition(t)
	ctx := context.Background()
	part := markerPartition(t, b)

	cpool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_generic_plan" })
	claimer, err := dedupactivity.New(cpool, opts)
	require.NoError(t, err)
	dedupactivity.SetAfterClaimHook(claimer, func(context.Context, pgx.Tx) error { return nil }) // claims first, as a retry
	fn := dedupactivity.Wrap(claimer, b.post)
	_, err = deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1}) // its statements prepared
	require.NoError(t, err)

	var blocked bool
	claimDone := make(chan error, 1)
	hook := countHook{part: &part, fn: func() {
		go func() {
			_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
			claimDone <- err
		}()
		// Until the claim has ended or waits for the partition's lock; a
		// claim still running when the check goes on would hold the
		// table's lock that the detach then waits for.
		for deadline := time.Now().Add(30 * time.Second); !blocked && len(claimDone) == 0; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Error("the claim neither ended nor waited within 30s")
				return
			}
			blocked = b.count(t, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = $1::regclass`, part) > 0
		}
	}}
	ppool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = hook })
	pruner, err := dedupactivity.New(ppool, opts)
	require.NoError(t, err)
	_, err = pruner.Prune(ctx)
	require.NoError(t, err)
	require.NoError(t, <-claimDone)
	require.False(t, blocked, "the claim waited for the expired partition's lock")
	require.Zero(t, b.tables(t, part), "the expired partition is dropped")
}

// TestPruneActivityHeartbeatsDuringALongStatement: the prune activity
// heartbeats on a clock, not only between batches and partitions, so one
// long statement (here the read of an expired partition that another
// transaction holds locked; in production, a large one) does not outlast
// its heartbeat timeout and make Temporal retry a live run.
func TestPruneActivityHeartbeatsDuringALongStatement(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 2, Retention: time.Minute}
	b := setup(t, opts)
	ctx := context.Background()
	past := time.Now().Truncate(iv).Add(-48 * iv)
	_, err := b.pool.Exec(ctx, `CREATE TABLE `+partitionName(past)+` PARTITION OF dedup_marker FOR VALUES FROM ('`+past.UTC().Format(time.RFC3339)+`') TO ('`+past.Add(iv).UTC().Format(time.RFC3339)+`')`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type) VALUES ('\x01', $1, 1, now() - interval '1 hour', 'T')`,
		past.Add(time.Minute))
	require.NoError(t, err)
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `LOCK TABLE `+partitionName(past)+` IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	d, err := dedupactivity.New(b.pool, opts)
	require.NoError(t, err)
	dedupactivity.SetPruneHeartbeat(d, 50*time.Millisecond)
	// Counted as the activity calls RecordHeartbeat (see HeartbeatCounter).
	beats, wait := temporaltest.RunActivity(func(env *testsuite.TestActivityEnvironment) {
		dedupactivity.RegisterPruner(activityRegistry{env: env}, d)
	}, dedupactivity.PruneActivityName(d))
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%`+partitionName(past)+`%'`) == 1
	}, 10*time.Second, 10*time.Millisecond, "the read of the locked partition waits")
	before := beats.Count()
	time.Sleep(time.Second)
	during := beats.Count() - before
	require.NoError(t, holder.Rollback(ctx))
	var res dedupactivity.PruneResult
	require.NoError(t, wait(&res), "the prune activity ends")
	require.GreaterOrEqual(t, during, int64(5), "heartbeats while one statement waited 1s (every 50ms)")
	require.Equal(t, int64(1), res.Deleted, "the partition, dropped once free")
}

// oldestPartitionStart is the start of table's oldest range partition, read
// from the partitions' names (<table>_p<Unix seconds>).
func oldestPartitionStart(t *testing.T, b *testBundle, table string) time.Time {
	t.Helper()
	return time.Unix(b.count(t, `SELECT min(substring(c.relname FROM '_p(\d+)$')::bigint) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = $1::regclass`, table), 0)
}

// TestPartitionBoundsReadInAnyDateStyle: the partitions' bounds are read
// back the same whatever the session's DateStyle and TimeZone. Outside the
// ISO DateStyle a bound prints with the zone's abbreviation, which
// PostgreSQL reads by its own list: Jakarta's WIB is not in it (every
// Migrate and Prune failed), and Dublin's summer IST is Israel's (+02 for
// +01), so a partition whose range crosses Dublin's change of clocks
// spanned 25h and was refused as made with another PartitionInterval.
func TestPartitionBoundsReadInAnyDateStyle(t *testing.T) {
	t.Parallel()
	iv := 24 * time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 1}
	b := setup(t, opts)
	ctx := context.Background()
	lo := time.Date(2026, 10, 25, 0, 0, 0, 0, time.UTC) // Dublin goes from IST to GMT at 01:00 UTC
	for _, tz := range []string{"Europe/Dublin", "Asia/Jakarta", "Asia/Kolkata", "Asia/Manila"} {
		for _, style := range []string{"SQL, DMY", "Postgres, MDY", "German"} {
			_, err := b.pool.Exec(ctx, `CREATE TABLE `+partitionName(lo)+` PARTITION OF dedup_marker FOR VALUES FROM ('`+lo.Format(time.RFC3339)+`') TO ('`+lo.Add(iv).Format(time.RFC3339)+`')`)
			require.NoError(t, err)
			pool := b.newPool(t, func(cfg *pgxpool.Config) {
				cfg.ConnConfig.RuntimeParams["DateStyle"] = style
				cfg.ConnConfig.RuntimeParams["TimeZone"] = tz
			})
			d, err := dedupactivity.New(pool, opts)
			require.NoError(t, err)
			require.NoError(t, d.Migrate(ctx), "%s, %s", tz, style)
			_, err = d.Prune(ctx)
			require.NoError(t, err, "%s, %s", tz, style)
			require.Zero(t, b.tables(t, partitionName(lo)),
				"%s, %s: the past partition, empty, is dropped", tz, style)
		}
	}
}

// TestMigrateRefusesTheOtherLayoutMadeMeanwhile: a Migrate that found no
// table, then waited for the migrations' lock while the other layout's
// table was made (another worker's Migrate, with the other Options, or a
// migration tool), refuses it as it refuses that table found at once. The
// default layout's files ran on the partitioned table: Migrate succeeded,
// with an expiry index on every partition, and every claim failed; the
// partitioned layout's failed on the plain table with "is not partitioned".
func TestMigrateRefusesTheOtherLayoutMadeMeanwhile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	partitioned := dedupactivity.Options{PartitionInterval: time.Hour, Retention: time.Hour}
	for name, c := range map[string]struct {
		made bool // the files of the partitioned layout made the table
		used dedupactivity.Options
	}{
		"PartitionedTableMadeMeanwhile": {true, dedupactivity.Options{}},
		"DefaultTableMadeMeanwhile":     {false, partitioned},
	} {
		t.Run(name, func(t *testing.T) {
			s := pgtest.NewSchema(t)
			app := "mig_" + s.Name
			pool := (&testBundle{schema: s}).newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["application_name"] = app })
			d, err := dedupactivity.New(pool, c.used)
			require.NoError(t, err)

			holder, err := s.Pool.Acquire(ctx) // the other worker's Migrate, holding the migrations' lock
			require.NoError(t, err)
			defer holder.Release()
			_, err = holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, dedupactivity.MigrateLockKey)
			require.NoError(t, err)
			done := make(chan error, 1)
			go func() { done <- d.Migrate(ctx) }()
			require.Eventually(t, func() bool {
				var n int
				return s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
					WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = $1`, app).Scan(&n) == nil && n == 1
			}, 10*time.Second, 5*time.Millisecond, "Migrate waits for the lock, having found no table")
			for _, sql := range upFiles(t, c.made) {
				_, err := holder.Exec(ctx, sql)
				require.NoError(t, err)
			}
			_, err = holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, dedupactivity.MigrateLockKey)
			require.NoError(t, err)
			err = <-done
			require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
			require.ErrorContains(t, err, "layout")
			require.Equal(t, int64(1), (&testBundle{schema: s, pool: s.Pool}).count(t,
				`SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = i.indkey[0]
				WHERE a.attname = 'expires_at' AND c.relnamespace = current_schema()::regnamespace`), "the table's own expiry index alone")
		})
	}
}

// TestOldestMarkerAgeInAnyDateStyle: the partitioned layout's oldest-marker
// gauge reads the oldest partition's start whatever the pool's DateStyle
// and TimeZone. In the SQL style Kolkata's "IST" was read back as Israel's
// (3.5h off) and Jakarta's "WIB" not at all (no observation).
func TestOldestMarkerAgeInAnyDateStyle(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	opts := dedupactivity.Options{Table: "parted", PartitionInterval: iv, PartitionsAhead: 1}
	d, err := dedupactivity.New(b.pool, opts)
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	current := oldestPartitionStart(t, b, "parted")
	for _, tz := range []string{"Asia/Kolkata", "Asia/Jakarta"} {
		pool := b.newPool(t, func(cfg *pgxpool.Config) {
			cfg.ConnConfig.RuntimeParams["DateStyle"] = "SQL, DMY"
			cfg.ConnConfig.RuntimeParams["TimeZone"] = tz
		})
		reader := sdkmetric.NewManualReader()
		opts.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
		_, err := dedupactivity.New(pool, opts)
		require.NoError(t, err)
		got := gaugeValues(t, reader, dedupactivity.MetricOldestMarkerAge)
		require.Len(t, got, 1, tz)
		require.InDelta(t, time.Since(current).Seconds(), got[0], 5, "%s: the current partition's start", tz)
	}
}

// TestPartitionMadeAheadBesideALongFirstAttempt: a first attempt whose
// claim rode with its effect as a look, and whose effect is still running,
// does not keep Prune from attaching a partition ahead, however the
// connection plans the look. Planned generically (as plan_cache_mode =
// auto does after a connection's fifth look), the look locked every
// partition, the default one included, until its commit: the attach, which
// takes the default partition's ACCESS EXCLUSIVE lock, waited out its lock
// timeout with the claims behind it, and the partition was left undone at
// every run that met an effect longer than 500ms.
func TestPartitionMadeAheadBesideALongFirstAttempt(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 2}
	b := setup(t, opts)
	ctx := context.Background()
	ahead := partitionName(time.Now().Truncate(iv).Add(2 * iv)) // at least an hour ahead
	dropPartition(t, b, ahead)

	cpool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_generic_plan" })
	claimer, err := dedupactivity.New(cpool, opts)
	require.NoError(t, err)
	running, release := make(chan struct{}), make(chan struct{})
	fn := dedupactivity.Wrap(claimer, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		p, err := b.post(ctx, tx, in) // its first statement rides with the look
		close(running)
		<-release
		return p, err
	})
	done := make(chan error, 1)
	go func() {
		_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
		done <- err
	}()
	<-running

	start := time.Now()
	_, err = b.d.Prune(ctx)
	took := time.Since(start)
	close(release)
	require.NoError(t, <-done)
	require.NoError(t, err)
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE c.relname = $1 AND i.inhparent = 'dedup_marker'::regclass`, ahead),
		"the partition ahead is made while the first attempt's effect runs (Prune took %s)", took)
	require.Equal(t, int64(1), b.ledgerRows(t))
	require.Equal(t, int64(1), b.markers(t))
}
