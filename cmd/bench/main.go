// Command bench measures what exactly-once costs, side by side with what
// users would do instead, on a real PostgreSQL, in one process, interleaved
// so that machine noise hits every approach alike:
//
//   - bare: the effect in a transaction, no deduplication (unsafe lower bound);
//   - dedupactivity: claim + effect + stored result in one transaction;
//   - status-record: claim an IN_PROGRESS row in its own transaction, the
//     effect in a second, then mark it COMPLETE (the usual generic
//     idempotency-library shape);
//   - check-then-insert: SELECT the key, then the effect plus a plain INSERT
//     of the key (what people write by hand).
//
// The effect is an INSERT of a ledger row plus an UPDATE of a balance row.
// It writes docs/bench.md and docs/bench.png. Run it with make bench.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type config struct {
	duration   time.Duration
	rounds     int
	levels     []int
	markers    int
	doubles    int
	out        string
	temporal   bool
	tOnly      bool
	prune      int
	activities int
	tRounds    int
	ledgerRows int
	only       string
	serial     int
}

const accounts = 1000

func run() error {
	var cfg config
	var levels string
	flag.DurationVar(&cfg.duration, "duration", 1500*time.Millisecond, "time per approach per concurrency level per round")
	flag.IntVar(&cfg.rounds, "rounds", 6, "interleaved rounds")
	flag.StringVar(&levels, "concurrency", "1,8,32", "concurrency levels")
	flag.IntVar(&cfg.markers, "markers", 10_000_000, "markers in the table for the large-table claim measurement")
	flag.IntVar(&cfg.doubles, "doubles", 300, "events delivered twice concurrently, per approach")
	flag.StringVar(&cfg.out, "out", "docs", "directory for bench.md and bench.png")
	flag.BoolVar(&cfg.temporal, "temporal", true, "also measure wrapped vs unwrapped activity throughput on a Temporal dev server")
	flag.IntVar(&cfg.activities, "activities", 400, "activities per Temporal measurement")
	flag.IntVar(&cfg.tRounds, "temporal-rounds", 12, "ABBA rounds of the Temporal measurement")
	flag.BoolVar(&cfg.tOnly, "temporal-only", false, "run only the Temporal measurement and print it")
	flag.IntVar(&cfg.prune, "prune", 1_000_000, "expired markers to prune while measuring claims (0: skip)")
	cpuprofile := flag.String("cpuprofile", "", "write this process's CPU profile to the file (with -only, say)")
	flag.StringVar(&cfg.only, "only", "", "semicolon-separated approach names to run (default: all)")
	flag.IntVar(&cfg.serial, "serial", 0, "deliver this many new events one after another with the one -only approach, print its allocations per event and exit: a fixed load to count instructions with valgrind (docs/design.md)")
	flag.IntVar(&cfg.ledgerRows, "effect-rows", 1, "ledger rows the effect inserts per event, one statement each (the issue's effect: 1)")
	flag.Parse()
	if cfg.ledgerRows < 1 {
		return fmt.Errorf("-effect-rows must be at least 1, got %d", cfg.ledgerRows)
	}
	for _, l := range strings.Split(levels, ",") {
		var n int
		if _, err := fmt.Sscan(l, &n); err != nil || n < 1 {
			return fmt.Errorf("bad -concurrency %q", levels)
		}
		cfg.levels = append(cfg.levels, n)
	}
	ctx := context.Background()
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}

	url, dataDir := os.Getenv("BENCH_DATABASE_URL"), ""
	if url == "" {
		fmt.Println("starting a PostgreSQL cluster from the local binaries (fsync on, synchronous_commit on)")
		c, err := pgtest.StartCluster("-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c shared_buffers=512MB")
		if err != nil {
			return fmt.Errorf("start PostgreSQL (or set BENCH_DATABASE_URL): %w", err)
		}
		defer c.Destroy() // best effort at exit
		url, dataDir = c.URL(), filepath.Join(c.Dir, "data")
	}
	var writes atomic.Int64
	pool, err := openPool(ctx, url, 40, &writes)
	if err != nil {
		return err
	}
	defer pool.Close()
	b := &bench{pool: pool, writes: &writes, cpu: newCPUMeter(dataDir), ledgerRows: cfg.ledgerRows}
	if err := b.setup(ctx); err != nil {
		return err
	}

	rep := &report{cfg: cfg}
	if rep.machine, err = machine(ctx, pool, dataDir != ""); err != nil {
		return err
	}
	if cfg.tOnly {
		if rep.temporal, err = temporalThroughput(ctx, url, b.cpu, cfg.activities, cfg.tRounds, b.effect); err != nil {
			return fmt.Errorf("temporal: %w", err)
		}
		fmt.Print(rep.temporal.markdown())
		return nil
	}
	approaches := b.approaches()
	if cfg.only != "" {
		keep := strings.Split(cfg.only, ";")
		approaches = slices.DeleteFunc(approaches, func(a approach) bool { return !slices.Contains(keep, a.name) })
	}

	if cfg.serial > 0 {
		if len(approaches) != 1 {
			return fmt.Errorf("-serial needs exactly one approach in -only, got %d", len(approaches))
		}
		return serial(ctx, approaches[0], cfg.serial)
	}

	fmt.Println("round trips per event ...")
	for _, a := range approaches {
		if a.reference && cfg.only == "" {
			continue
		}
		rt, dupRT, err := b.roundTrips(ctx, a)
		if err != nil {
			return fmt.Errorf("%s round trips: %w", a.name, err)
		}
		rep.roundTrips = append(rep.roundTrips, roundTrips{a.name, rt, dupRT})
	}

	fmt.Println("warm-up (not measured) ...")
	if err := b.warmUp(ctx, approaches, cfg.levels, cfg.duration/5); err != nil {
		return err
	}

	fmt.Printf("throughput: %d rounds x %v x %d approaches x %v ...\n", cfg.rounds, cfg.duration, len(approaches), cfg.levels)
	cells := map[string]*cell{}
	for r := range cfg.rounds {
		for _, c := range cfg.levels {
			order := slices.Clone(approaches)
			rand.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
			for _, a := range order {
				key := fmt.Sprintf("%s/%d", a.name, c)
				if cells[key] == nil {
					cells[key] = &cell{approach: a.name, conc: c}
				}
				if err := b.load(ctx, a, c, cfg.duration, fmt.Sprintf("r%d", r), cells[key]); err != nil {
					return fmt.Errorf("%s at %d: %w", a.name, c, err)
				}
			}
		}
		fmt.Printf("  round %d/%d done\n", r+1, cfg.rounds)
	}
	for _, a := range approaches {
		for _, c := range cfg.levels {
			rep.cells = append(rep.cells, cells[fmt.Sprintf("%s/%d", a.name, c)])
		}
	}

	if cfg.only != "" {
		// A subset of rows: their round trips, throughput and CPU only, to
		// stdout.
		for _, rt := range rep.roundTrips {
			fmt.Printf("%-46s round trips: %d first, %d duplicate\n", rt.approach, rt.first, rt.dup)
		}
		for _, c := range rep.cells {
			server, client := c.cpuPerEvent()
			fmt.Printf("%-46s %3d %7.0f/s  server %s µs  client %s µs  WAL %s B  %.2f writes\n", c.approach, c.conc, c.throughput(), server, client, c.walPerEvent(), float64(c.writes)/float64(max(c.events, 1)))
		}
		return nil
	}

	if cfg.temporal {
		// Before the large-table and pruning measurements, whose writes
		// (10M markers, 1M deleted) leave checkpoints and autovacuum
		// running in the background of whatever comes next (it still
		// follows the throughput rounds' writes).
		fmt.Println("Temporal dev server: wrapped vs unwrapped activity throughput ...")
		if rep.temporal, err = temporalThroughput(ctx, url, b.cpu, cfg.activities, cfg.tRounds, b.effect); err != nil {
			return fmt.Errorf("temporal: %w", err)
		}
	}

	fmt.Println("double delivery ...")
	for _, a := range approaches {
		if a.reference {
			continue
		}
		d, failed, err := b.doubleDelivery(ctx, a, cfg.doubles)
		if err != nil {
			return fmt.Errorf("%s double delivery: %w", a.name, err)
		}
		rep.doubles = append(rep.doubles, doubles{a.name, d, failed})
	}

	fmt.Println("duplicate path ...")
	if rep.firstP50, rep.dupP50, err = b.duplicatePath(ctx, 500); err != nil {
		return err
	}

	fmt.Printf("claim latency with 0 and %d markers ...\n", cfg.markers)
	if rep.emptyP50, rep.fullP50, rep.bytesPerMarker, err = b.largeTable(ctx, cfg.markers); err != nil {
		return err
	}

	if cfg.prune > 0 {
		fmt.Printf("claims while pruning %d expired markers ...\n", cfg.prune)
		if rep.prune, err = b.pruneBench(ctx, cfg.prune); err != nil {
			return fmt.Errorf("prune: %w", err)
		}
	}

	return rep.write()
}

// warmUp opens the connections the highest level needs, so that round 0's
// first row at each level does not pay for opening them (a backend's start,
// in the server's CPU time and the row's elapsed time), then runs every
// approach at every level for d, in random order, into cells that are
// dropped: every row starts round 0 with its statements prepared on every
// connection and its tables' pages in the cache.
func (b *bench) warmUp(ctx context.Context, approaches []approach, levels []int, d time.Duration) error {
	conns := make([]*pgxpool.Conn, 0, slices.Max(levels))
	for range cap(conns) {
		c, err := b.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	for _, c := range levels {
		order := slices.Clone(approaches)
		rand.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		for _, a := range order {
			if err := b.load(ctx, a, c, d, "w", &cell{approach: a.name, conc: c}); err != nil {
				return fmt.Errorf("warm-up: %s at %d: %w", a.name, c, err)
			}
		}
	}
	return nil
}

// serial delivers n new events one after another with a and prints the
// heap allocations per event. Run under valgrind --tool=callgrind twice
// (two values of n), the difference in instructions divided by the
// difference in n is the approach's cost per event, whatever the machine is
// doing meanwhile.
func serial(ctx context.Context, a approach, n int) error {
	var before, after runtime.MemStats
	// Every run starts its events right after a collection, so what the
	// setup before left on the heap does not move the collections within
	// them; the cycles are printed to compare runs (the run-to-run spread
	// of the client's count is elsewhere: see instructions.sh).
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range n {
		key := fmt.Sprintf("serial-%d", i)
		if _, err := a.deliver(ctx, key, newPosting(key)); err != nil {
			return fmt.Errorf("%s: event %d: %w", a.name, i, err)
		}
	}
	runtime.ReadMemStats(&after)
	fmt.Printf("%s: %d events, %.1f allocations and %.0f bytes allocated per event, %d GC cycles\n", a.name, n,
		float64(after.Mallocs-before.Mallocs)/float64(n), float64(after.TotalAlloc-before.TotalAlloc)/float64(n), after.NumGC-before.NumGC)
	return nil
}

func openPool(ctx context.Context, url string, maxConns int32, writes *atomic.Int64) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = maxConns
	pgtest.CountRoundTrips(cfg.ConnConfig, writes)
	return pgxpool.NewWithConfig(ctx, cfg)
}

// machine describes the machine and the server, with the durability
// settings the server reports (not the ones the bench asked for: a server
// from BENCH_DATABASE_URL has its own).
func machine(ctx context.Context, pool *pgxpool.Pool, local bool) (string, error) {
	var pg, fsync, syncCommit, iso string
	if err := pool.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('fsync'), current_setting('synchronous_commit'), current_setting('default_transaction_isolation')`).Scan(&pg, &fsync, &syncCommit, &iso); err != nil {
		return "", err
	}
	where := "on the same machine"
	if !local {
		where = "from BENCH_DATABASE_URL"
	}
	cpu := "unknown CPU"
	if raw, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(raw), "\n") {
			if strings.HasPrefix(l, "model name") {
				cpu = strings.TrimSpace(strings.SplitN(l, ":", 2)[1])
				break
			}
		}
	}
	// dedupactivity begins READ COMMITTED whatever the default; bare, the
	// seed recipe and the other rows' plain BEGIN take the default.
	return fmt.Sprintf("%d cores (%s), %s, PostgreSQL %s %s (fsync %s, synchronous_commit %s, default_transaction_isolation %s)", runtime.NumCPU(), cpu, runtime.Version(), pg, where, fsync, syncCommit, iso), nil
}

func gitDescribe() string {
	out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(out))
}

var errInProgress = errors.New("in progress elsewhere: retry later")

func ensureDir(p string) error { return os.MkdirAll(filepath.Dir(p), 0o755) }
