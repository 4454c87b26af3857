package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

type pruneResult struct {
	expired                 int
	beforeP50, beforeP99    time.Duration
	duringP50, duringP99    time.Duration
	pruned                  int64
	pruneTook               time.Duration
	windowSizes             []int64 // table+index bytes after each retention window
	windowRows, windowCount int
}

// pruneBench measures claims (8 goroutines, empty effect) before and while
// Prune deletes n expired markers, and the marker table's size over
// retention windows of steady load, each followed by a prune and a VACUUM.
func (b *bench) pruneBench(ctx context.Context, n int) (*pruneResult, error) {
	res := &pruneResult{expired: n, windowRows: 200_000, windowCount: 4}
	d, err := dedupactivity.New(b.pool, dedupactivity.Options{Table: "dedup_prune"})
	if err != nil {
		return nil, err
	}
	if err := d.Migrate(ctx); err != nil {
		return nil, err
	}
	fill := func(lo, hi int, expires string) error {
		_, err := b.pool.Exec(ctx, `
INSERT INTO dedup_prune (id_hash, activity_type, result, attempt, expires_at)
SELECT sha256(int8send(g)), 'Post', convert_to('{"EntryID":' || g || '}', 'UTF8'), 1, `+expires+`
FROM generate_series($1::bigint, $2::bigint - 1) g`, lo, hi)
		return err
	}
	for lo := 0; lo < n; lo += 500_000 {
		if err := fill(lo, min(n, lo+500_000), "now() - interval '1 hour'"); err != nil {
			return nil, err
		}
	}
	if _, err := b.pool.Exec(ctx, `VACUUM ANALYZE dedup_prune`); err != nil {
		return nil, err
	}

	noop := func(context.Context, pgx.Tx, posting) (receipt, error) { return receipt{EntryID: 1}, nil }
	var seq atomic.Int64
	claims := func(stop <-chan struct{}, dur time.Duration) ([]time.Duration, error) {
		var mu sync.Mutex
		var all []time.Duration
		var wg sync.WaitGroup
		var firstErr atomic.Value
		deadline := time.Now().Add(dur)
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				deadline := deadline // this goroutine's: stop moves it without a data race
				var ls []time.Duration
				for time.Now().Before(deadline) {
					select {
					case <-stop:
						deadline = time.Now()
						continue
					default:
					}
					key := fmt.Sprintf("pr-%d", seq.Add(1))
					id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "bench", ActivityType: "Post", Key: key}
					t0 := time.Now()
					if _, _, err := dedupactivity.Do(ctx, d, id, newPosting(key), noop); err != nil {
						firstErr.CompareAndSwap(nil, err)
						return
					}
					ls = append(ls, time.Since(t0))
				}
				mu.Lock()
				all = append(all, ls...)
				mu.Unlock()
			}()
		}
		wg.Wait()
		if e, ok := firstErr.Load().(error); ok {
			return nil, e
		}
		return all, nil
	}
	before, err := claims(nil, 5*time.Second)
	if err != nil {
		return nil, err
	}
	res.beforeP50, res.beforeP99 = percentile(before, 0.5), percentile(before, 0.99)

	stop := make(chan struct{})
	var pruneErr error
	go func() {
		t0 := time.Now()
		res.pruned, pruneErr = d.Prune(ctx)
		res.pruneTook = time.Since(t0)
		close(stop)
	}()
	during, err := claims(stop, 10*time.Minute)
	if err != nil {
		return nil, err
	}
	<-stop
	if pruneErr != nil {
		return nil, pruneErr
	}
	res.duringP50, res.duringP99 = percentile(during, 0.5), percentile(during, 0.99)

	// Retention windows of steady load, on a fresh table: each window's
	// markers expire at its end; the prune after it removes them and VACUUM
	// makes the space reusable (what autovacuum does on its own schedule).
	if _, err := b.pool.Exec(ctx, `DROP TABLE dedup_prune`); err != nil {
		return nil, err
	}
	if _, err := b.pool.Exec(ctx, `DELETE FROM dedup_prune_migration`); err != nil {
		return nil, err
	}
	if err := d.Migrate(ctx); err != nil {
		return nil, err
	}
	next := n
	for range res.windowCount {
		if err := fill(next, next+res.windowRows, "now() + interval '1 second'"); err != nil {
			return nil, err
		}
		next += res.windowRows
		time.Sleep(1100 * time.Millisecond)
		if _, err := d.Prune(ctx); err != nil {
			return nil, err
		}
		if _, err := b.pool.Exec(ctx, `VACUUM dedup_prune`); err != nil {
			return nil, err
		}
		// Size at the window's peak is what the next window starts from.
		var size int64
		if err := b.pool.QueryRow(ctx, `SELECT pg_total_relation_size('dedup_prune')`).Scan(&size); err != nil {
			return nil, err
		}
		res.windowSizes = append(res.windowSizes, size)
	}
	return res, nil
}
