package dedupactivity_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// TestPruneDeletesInBatchesOf1000 pins the batch bound of Prune (design.md,
// "Retention"): 2,500 expired markers go in three statements of at most
// 1,000 rows, 1,000, 1,000 and 500, not in one statement nor in batches of
// another size.
func TestPruneDeletesInBatchesOf1000(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `
INSERT INTO dedup_marker (id_hash, activity_type, attempt, expires_at)
SELECT sha256(int4send(g)), 'T', 1, now() - interval '1 hour' FROM generate_series(1, 2500) g`)
	require.NoError(t, err)
	var after []int64 // the count deleted so far, after each batch
	n, err := dedupactivity.PruneWithProgress(ctx, b.d, func(deleted int64) { after = append(after, deleted) })
	require.NoError(t, err)
	require.Equal(t, int64(2500), n)
	require.Equal(t, []int64{1000, 2000, 2500}, after)
	require.Zero(t, b.markers(t))
}

// TestPruneSkipsMarkersLockedElsewhere pins FOR UPDATE SKIP LOCKED in the
// prune statement: an expired marker whose row another transaction (a
// concurrent pruner) holds is skipped, not waited for, and the other
// expired markers go. The pruner's lock_timeout turns a wait into an error.
func TestPruneSkipsMarkersLockedElsewhere(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `
INSERT INTO dedup_marker (id_hash, activity_type, attempt, expires_at)
SELECT sha256(int4send(g)), 'T', 1, now() - interval '1 hour' FROM generate_series(1, 3) g`)
	require.NoError(t, err)
	holder, err := b.pool.Begin(ctx) // another pruner, between its select and its delete
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT 1 FROM dedup_marker WHERE id_hash = sha256(int4send(1)) FOR UPDATE`)
	require.NoError(t, err)

	pool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["lock_timeout"] = "1s" })
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	require.NoError(t, err)
	n, err := d.Prune(ctx)
	require.NoError(t, err, "the locked marker is skipped, not waited for")
	require.Equal(t, int64(2), n)
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM dedup_marker WHERE id_hash = sha256(int4send(1))`), "the locked marker stays")
}

// TestPruneGoesOnWhenTheNextPartitionCannotBeMade pins that Prune's later
// steps run when making the partitions ahead fails (design.md: "each of its
// steps runs whatever the others' errors"): the next interval's partition
// cannot be made while a claim routed to the default partition holds it,
// and the run fails, but the default partition's expired marker is still
// pruned.
func TestPruneGoesOnWhenTheNextPartitionCannotBeMade(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 2}
	b := setup(t, opts)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type)
		VALUES ('\x01', now() - interval '1000 hours', 1, now() - interval '1 hour', 'T')`) // to the default partition, expired
	require.NoError(t, err)
	next := partitionName(time.Now().Truncate(iv).Add(iv))
	dropPartition(t, b, next)
	long, err := b.pool.Begin(ctx) // a claim routed to the default partition, its effect running
	require.NoError(t, err)
	defer func() { _ = long.Rollback(ctx) }()
	_, err = long.Exec(ctx, `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type)
		VALUES ('\x02', now() - interval '1000 hours', 1, now() + interval '1 hour', 'T')`)
	require.NoError(t, err)

	n, err := b.d.Prune(ctx)
	require.ErrorContains(t, err, "create partition "+next)
	require.Equal(t, "55P03", sqlStateOf(err))
	require.Equal(t, int64(1), n, "the default partition's expired marker")
	require.Zero(t, b.count(t, `SELECT count(*) FROM dedup_marker_default WHERE expires_at < now()`))
}

// TestPruneLeavesAFarAheadPartitionToTheNextRun pins the other side of the
// lock-timeout rule of the partitions ahead: one whose range starts more
// than an interval ahead and whose lock was not granted is left to the next
// run without failing this one; once the lock is free, Prune makes it.
func TestPruneLeavesAFarAheadPartitionToTheNextRun(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	b := setup(t, dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 2})
	ctx := context.Background()
	far := partitionName(time.Now().Truncate(iv).Add(2 * iv))
	dropPartition(t, b, far)
	made := func() int64 {
		return b.tables(t, far)
	}
	long, err := b.pool.Begin(ctx) // a claim routed to the default partition, which the attach locks
	require.NoError(t, err)
	defer func() { _ = long.Rollback(ctx) }()
	_, err = long.Exec(ctx, `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type)
		VALUES ('\x01', now() - interval '1000 hours', 1, now() + interval '1 hour', 'T')`)
	require.NoError(t, err)

	_, err = b.d.Prune(ctx)
	require.NoError(t, err, "a partition two intervals ahead is left to the next run")
	require.Zero(t, made())
	require.NoError(t, long.Rollback(ctx))
	_, err = b.d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), made(), "the next run makes it")
}

// insertOnLock runs fn when a statement locking the partition *part starts
// on the pruner's connection (before the lock is requested).
type insertOnLock struct {
	part string
	once sync.Once
	fn   func()
}

func (h *insertOnLock) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "LOCK TABLE ") && strings.Contains(d.SQL, h.part) {
		h.once.Do(h.fn)
	}
	return ctx
}

func (*insertOnLock) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// pastPartition makes the marker table's range partition of one interval
// iv starting at lo, in the past, and puts in it one marker that expired
// an hour ago.
func pastPartition(t *testing.T, b *testBundle, lo time.Time, iv time.Duration, id string) string {
	t.Helper()
	name := partitionName(lo)
	_, err := b.pool.Exec(context.Background(), `CREATE TABLE `+name+` PARTITION OF dedup_marker FOR VALUES FROM ('`+lo.UTC().Format(time.RFC3339)+`') TO ('`+lo.Add(iv).UTC().Format(time.RFC3339)+`')`)
	require.NoError(t, err)
	_, err = b.pool.Exec(context.Background(), `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type)
		VALUES ($1, $2, 1, now() - interval '1 hour', 'T')`, []byte(id), lo.Add(time.Minute))
	require.NoError(t, err)
	return name
}

// TestDropRechecksThePartitionUnderItsLock pins the second check of a past
// partition, under its own lock: a marker that has not expired, committed
// after the unlocked read found none (a late redelivery of the range)
// and before the lock, keeps the partition, which is not dropped with it.
func TestDropRechecksThePartitionUnderItsLock(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 1, Retention: time.Minute}
	b := setup(t, opts)
	ctx := context.Background()
	lo := time.Now().Truncate(iv).Add(-48 * iv)
	part := pastPartition(t, b, lo, iv, "\x01")
	hook := &insertOnLock{part: part, fn: func() {
		_, err := b.pool.Exec(ctx, `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type)
			VALUES ('\x02', $1, 1, now() + interval '1 hour', 'T')`, lo.Add(time.Minute))
		require.NoError(t, err)
	}}
	pool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = hook })
	d, err := dedupactivity.New(pool, opts)
	require.NoError(t, err)
	n, err := d.Prune(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	require.Equal(t, int64(2), b.count(t, `SELECT count(*) FROM `+part), "the partition stays, with the live marker")
}

// TestPruneGoesOnPastAnUnreadablePartitionToTheNext pins that a past
// partition Prune cannot read does not keep it from dropping the other
// expired past partitions. Either partition is made unreadable in turn, so
// that the unreadable one is read first in one of the runs whatever the
// catalog's order.
func TestPruneGoesOnPastAnUnreadablePartitionToTheNext(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 1, Retention: time.Minute}
	for _, locked := range []int{0, 1} {
		t.Run(strconv.Itoa(locked), func(t *testing.T) {
			b := setup(t, opts)
			ctx := context.Background()
			now := time.Now().Truncate(iv)
			parts := []string{pastPartition(t, b, now.Add(-48*iv), iv, "\x01"), pastPartition(t, b, now.Add(-72*iv), iv, "\x02")}
			holder, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = holder.Rollback(ctx) }() // before the schema's cleanup, which waits for its lock
			_, err = holder.Exec(ctx, `LOCK TABLE `+parts[locked]+` IN ACCESS EXCLUSIVE MODE`)
			require.NoError(t, err)

			pool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["statement_timeout"] = "300" })
			d, err := dedupactivity.New(pool, opts)
			require.NoError(t, err)
			n, err := d.Prune(ctx)
			require.ErrorContains(t, err, "read partition "+parts[locked])
			require.Equal(t, int64(1), n, "the other partition's marker")
			require.NoError(t, holder.Rollback(ctx))
			require.Zero(t, b.tables(t, parts[1-locked]),
				"the readable partition is dropped")
			require.Equal(t, int64(1), b.tables(t, parts[locked]))
		})
	}
}

// TestPruneFailsOnAPartitionWhoseNameDoesNotResolve pins the other side of
// the pass over a partition "dropped meanwhile": a partition still attached
// whose name does not resolve under the pruner's search_path (here, one
// made in another schema) is an error, not taken as dropped by another
// pruner and passed over in silence.
func TestPruneFailsOnAPartitionWhoseNameDoesNotResolve(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 1, Retention: time.Minute}
	b := setup(t, opts)
	ctx := context.Background()
	other := pgx.Identifier{b.schema.Name + "_elsewhere"}.Sanitize()
	_, err := b.pool.Exec(ctx, `CREATE SCHEMA `+other)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = b.pool.Exec(context.Background(), `DROP SCHEMA `+other+` CASCADE`) })
	lo := time.Now().Truncate(iv).Add(-48 * iv)
	name := partitionName(lo)
	_, err = b.pool.Exec(ctx, `CREATE TABLE `+other+`.`+name+` PARTITION OF dedup_marker FOR VALUES FROM ('`+lo.UTC().Format(time.RFC3339)+`') TO ('`+lo.Add(iv).UTC().Format(time.RFC3339)+`')`)
	require.NoError(t, err)

	_, err = b.d.Prune(ctx)
	require.ErrorContains(t, err, "read partition "+name)
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'dedup_marker'::regclass AND inhrelid = $1::regclass`, other+"."+name), "still attached")
}

// TestPartitionLockWaitIsBounded pins partitionLockTimeout (500ms, "claims
// queue behind a waiting lock request, so it is kept short"): a partition
// ahead whose lock a claim holds fails the run after that wait, well under
// 4s, not after a longer one (a wait of 5s fails it), with room for a loaded machine.
func TestPartitionLockWaitIsBounded(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	b := setup(t, dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 2})
	ctx := context.Background()
	next := partitionName(time.Now().Truncate(iv).Add(iv))
	dropPartition(t, b, next)
	long, err := b.pool.Begin(ctx) // a claim routed to the default partition, its effect running
	require.NoError(t, err)
	defer func() { _ = long.Rollback(ctx) }()
	_, err = long.Exec(ctx, `INSERT INTO dedup_marker (id_hash, scheduled_at, attempt, expires_at, activity_type)
		VALUES ('\x01', now() - interval '1000 hours', 1, now() + interval '1 hour', 'T')`)
	require.NoError(t, err)

	start := time.Now()
	_, err = b.d.Prune(ctx)
	elapsed := time.Since(start)
	require.Equal(t, "55P03", sqlStateOf(err), "%v", err)
	require.GreaterOrEqual(t, elapsed, 500*time.Millisecond, "the lock is waited for")
	require.Less(t, elapsed, 4*time.Second, "the lock is waited for 500ms, not longer")
}

// lockRecorder records the statements that lock a table.
type lockRecorder struct {
	mu    sync.Mutex
	locks []string
}

func (r *lockRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "LOCK TABLE ") {
		r.mu.Lock()
		r.locks = append(r.locks, d.SQL)
		r.mu.Unlock()
	}
	return ctx
}

func (*lockRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestPruneReadsALivePartitionWithoutItsLock pins the first, unlocked read
// of a past partition (design.md: "the partitions still within their
// retention are passed over without blocking claims"): a past partition
// holding a marker that has not expired is never locked, so a claim of its
// range (which holds it in ROW EXCLUSIVE mode) is not waited for, and the
// partition stays. TestPartitionedLayout's reader holds ACCESS SHARE, which
// the pruner's EXCLUSIVE lock does not wait for either.
func TestPruneReadsALivePartitionWithoutItsLock(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 1, Retention: time.Minute}
	b := setup(t, opts)
	ctx := context.Background()
	lo := time.Now().Truncate(iv).Add(-48 * iv)
	part := pastPartition(t, b, lo, iv, "\x01")
	_, err := b.pool.Exec(ctx, `UPDATE dedup_marker SET expires_at = now() + interval '1 hour'`)
	require.NoError(t, err)
	claim, err := b.pool.Begin(ctx) // a late claim of the range, its effect running
	require.NoError(t, err)
	defer func() { _ = claim.Rollback(ctx) }()
	_, err = claim.Exec(ctx, `LOCK TABLE `+part+` IN ROW EXCLUSIVE MODE`)
	require.NoError(t, err)

	rec := &lockRecorder{}
	pool := b.newPool(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = rec })
	d, err := dedupactivity.New(pool, opts)
	require.NoError(t, err)
	n, err := d.Prune(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
	rec.mu.Lock()
	for _, sql := range rec.locks {
		require.NotContains(t, sql, part, "the live partition was locked")
	}
	rec.mu.Unlock()
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM `+part))
}

// TestDropLeavesAPartitionItCannotLockToTheNextRun pins that an expired
// past partition whose lock is not granted within the lock timeout (a
// claim of its range holds it) is left to the next run, not reported as
// an error; the next run, once the lock is free, drops it.
func TestDropLeavesAPartitionItCannotLockToTheNextRun(t *testing.T) {
	t.Parallel()
	iv := time.Hour
	opts := dedupactivity.Options{PartitionInterval: iv, PartitionsAhead: 1, Retention: time.Minute}
	b := setup(t, opts)
	ctx := context.Background()
	part := pastPartition(t, b, time.Now().Truncate(iv).Add(-48*iv), iv, "\x01")
	exists := func() int64 {
		return b.tables(t, part)
	}
	claim, err := b.pool.Begin(ctx) // a late claim of the range, its effect running
	require.NoError(t, err)
	defer func() { _ = claim.Rollback(ctx) }()
	_, err = claim.Exec(ctx, `LOCK TABLE `+part+` IN ROW EXCLUSIVE MODE`)
	require.NoError(t, err)

	n, err := b.d.Prune(ctx)
	require.NoError(t, err, "the partition is left to the next run")
	require.Zero(t, n)
	require.Equal(t, int64(1), exists())
	require.NoError(t, claim.Rollback(ctx))
	n, err = b.d.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Zero(t, exists(), "the next run drops it")
}
