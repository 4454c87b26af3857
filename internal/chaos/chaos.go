// Package chaos runs the ledger example under faults: several worker
// processes on a real Temporal dev server and a real PostgreSQL, while the
// harness SIGKILLs workers, terminates their database backends, forces
// redeliveries and restarts PostgreSQL. It then checks that every transfer
// was applied exactly once and nothing was lost.
package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.temporal.io/sdk/client"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
	"github.com/dedupactivity/dedupactivity/workflows"
)

// Config sets the run's size and faults.
type Config struct {
	// Duration of the fault phase; workflows are started throughout it.
	Duration time.Duration
	// Workers is the number of worker processes kept running.
	Workers int
	// Rate is workflows started per second.
	Rate float64
	// KillEvery is the mean interval between worker SIGKILLs.
	KillEvery time.Duration
	// TerminateEvery is the mean interval between pg_terminate_backend calls.
	TerminateEvery time.Duration
	// RestartPostgres restarts PostgreSQL (fast shutdown + start) once, half
	// way through. Only possible on a cluster the harness started.
	RestartPostgres bool
	// Drain bounds the wait for workflows after the fault phase.
	Drain time.Duration
	// Log receives progress lines.
	Log io.Writer
}

// Report is what a run saw and checked.
type Report struct {
	Started, Completed, Failed int
	Attempts                   map[string]int64 // by dedup outcome (lower bounds: see CountsToFile)
	Effects, Expected          int64            // ledger rows, and 2 per completed transfer
	Doubles, Lost              int              // transfers applied twice; completed transfers missing an effect
	Mismatched                 int              // receipts not matching the ledger
	Money, WantMoney           int64
	Kills, Terminations        int
	Restarts                   int
	Took                       time.Duration
	Violations                 []string
}

// OK says whether every invariant held.
func (r *Report) OK() bool { return len(r.Violations) == 0 }

const (
	accounts = 20
	balance  = 1_000_000
	appName  = "chaos-worker"
)

// Run runs the chaos harness. It starts its own PostgreSQL cluster and
// Temporal dev server (TEMPORAL_ADDRESS is honoured).
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	began := time.Now()
	rep := &Report{Attempts: map[string]int64{}}
	logf := func(format string, args ...any) { fmt.Fprintf(cfg.Log, format+"\n", args...) }

	cluster, err := pgtest.StartCluster()
	if err != nil {
		return nil, fmt.Errorf("start PostgreSQL: %w", err)
	}
	defer cluster.Destroy() //nolint:errcheck // best effort at exit
	srv, err := temporaltest.Start(ctx, temporaltest.Options{})
	if err != nil {
		return nil, err
	}
	defer srv.Stop() //nolint:errcheck // best effort at exit

	dir, err := os.MkdirTemp("", "chaos-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "worker")
	logf("building the worker ...")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/dedupactivity/dedupactivity/worker").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build worker: %w: %s", err, out)
	}

	pool, err := pgxpool.New(ctx, cluster.URL())
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	if err != nil {
		return nil, err
	}
	if err := d.Migrate(ctx); err != nil {
		return nil, err
	}
	if err := activities.Migrate(ctx, pool); err != nil {
		return nil, err
	}
	ids := make([]string, accounts)
	for i := range ids {
		ids[i] = fmt.Sprintf("acct-%02d", i)
	}
	if err := activities.OpenAccounts(ctx, pool, balance, ids...); err != nil {
		return nil, err
	}
	rep.WantMoney = accounts * balance

	taskQueue := fmt.Sprintf("chaos-%d", time.Now().UnixNano())
	workers := &fleet{bin: bin, dir: dir, env: []string{
		"TEMPORAL_ADDRESS=" + srv.Address,
		"TASK_QUEUE=" + taskQueue,
		"DATABASE_URL=" + cluster.URL() + "&application_name=" + appName,
	}}
	defer workers.stopAll()
	for range cfg.Workers {
		if err := workers.start(); err != nil {
			return nil, err
		}
	}

	c, err := srv.Dial()
	if err != nil {
		return nil, err
	}
	defer c.Close()
	supervise, stopSupervising := context.WithCancel(ctx)
	defer stopSupervising()
	go workers.keep(supervise, cfg.Workers)

	// Fault phase: start workflows and inject faults until Duration.
	phase, stop := context.WithTimeout(ctx, cfg.Duration)
	defer stop()
	var runs []started
	var runsMu sync.Mutex
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // starter
		defer wg.Done()
		tick := time.NewTicker(time.Duration(float64(time.Second) / cfg.Rate))
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-phase.Done():
				return
			case <-tick.C:
			}
			from := rand.IntN(accounts)
			req := workflows.TransferRequest{
				TransferID: fmt.Sprintf("%s-%05d", taskQueue, i), From: ids[from], To: ids[(from+1+rand.IntN(accounts-1))%accounts],
				Amount: 1 + rand.Int64N(50), StartToClose: 3 * time.Second,
				Faults: activities.Faults{LoseCompletion: i%4 == 0},
			}
			if i%7 == 3 {
				req.Faults.StallCredit = 3500 * time.Millisecond
			}
			run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: req.TransferID, TaskQueue: taskQueue}, workflows.TransferWorkflowName, req)
			if err != nil {
				logf("start %s: %v", req.TransferID, err)
				continue
			}
			runsMu.Lock()
			runs = append(runs, started{req: req, run: run})
			runsMu.Unlock()
		}
	}()
	var kills, terms, restarts atomic.Int64
	wg.Add(1)
	go func() { // worker killer
		defer wg.Done()
		for sleep(phase, jitter(cfg.KillEvery)) {
			if err := workers.killOne(); err != nil {
				logf("kill: %v", err)
				continue
			}
			kills.Add(1)
			if err := workers.start(); err != nil {
				logf("restart worker: %v", err)
			}
		}
	}()
	wg.Add(1)
	go func() { // backend terminator
		defer wg.Done()
		for sleep(phase, jitter(cfg.TerminateEvery)) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE application_name = $1 ORDER BY random() LIMIT 1) t`, appName).Scan(&n)
			if err == nil {
				terms.Add(int64(n))
			}
		}
	}()
	if cfg.RestartPostgres {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if !sleep(phase, cfg.Duration/2) {
				return
			}
			logf("restarting PostgreSQL (fast shutdown) ...")
			if err := cluster.Stop(); err != nil {
				logf("stop PostgreSQL: %v", err)
				return
			}
			time.Sleep(500 * time.Millisecond)
			if err := cluster.Start(); err != nil {
				logf("start PostgreSQL: %v", err)
				return
			}
			restarts.Add(1)
		}()
	}
	progress := time.NewTicker(10 * time.Second)
	defer progress.Stop()
	go func() {
		for {
			select {
			case <-phase.Done():
				return
			case <-progress.C:
				runsMu.Lock()
				n := len(runs)
				runsMu.Unlock()
				logf("  %s: %d workflows started, %d workers killed, %d backends terminated", time.Since(began).Round(time.Second), n, kills.Load(), terms.Load())
			}
		}
	}()
	wg.Wait()
	rep.Kills, rep.Terminations, rep.Restarts = int(kills.Load()), int(terms.Load()), int(restarts.Load())
	logf("fault phase over: draining %d workflows ...", len(runs))

	// Drain: every workflow must finish, with the surviving workers.
	drain, cancel := context.WithTimeout(ctx, cfg.Drain)
	defer cancel()
	results := make([]workflows.TransferResult, len(runs))
	errs := make([]error, len(runs))
	var dwg sync.WaitGroup
	for i, r := range runs {
		dwg.Add(1)
		go func() {
			defer dwg.Done()
			errs[i] = r.run.Get(drain, &results[i])
		}()
	}
	dwg.Wait()
	stopSupervising()
	time.Sleep(500 * time.Millisecond) // let workers snapshot their counts
	workers.stopAll()

	if err := check(ctx, pool, rep, runs, results, errs); err != nil {
		return nil, err
	}
	rep.Attempts, err = workers.counts()
	if err != nil {
		return nil, err
	}
	rep.Took = time.Since(began)
	return rep, nil
}

type started struct {
	req workflows.TransferRequest
	run client.WorkflowRun
}

func check(ctx context.Context, pool *pgxpool.Pool, rep *Report, runs []started, results []workflows.TransferResult, errs []error) error {
	rep.Started = len(runs)
	ids := make([]string, len(runs))
	for i, r := range runs {
		ids[i] = r.req.TransferID
	}
	ledger, err := activities.Audit(ctx, pool, ids)
	if err != nil {
		return err
	}
	for i, r := range runs {
		completed := errs[i] == nil
		if completed {
			rep.Completed++
			rep.Expected += 2
		} else {
			rep.Failed++
			rep.Violations = append(rep.Violations, fmt.Sprintf("workflow %s did not complete: %v", r.req.TransferID, errs[i]))
		}
		l := ledger[r.req.TransferID]
		problem, double := l.Check(r.req.TransferID, completed, results[i].Debit, results[i].Credit)
		switch {
		case double:
			rep.Doubles++
		case problem != "" && (l.Debits == 0 || l.Credits == 0):
			rep.Lost++
		case problem != "":
			rep.Mismatched++
		}
		if problem != "" {
			rep.Violations = append(rep.Violations, problem)
		}
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entry`).Scan(&rep.Effects); err != nil {
		return err
	}
	if rep.Effects != rep.Expected {
		rep.Violations = append(rep.Violations, fmt.Sprintf("%d effects applied, want %d", rep.Effects, rep.Expected))
	}
	if err := pool.QueryRow(ctx, `SELECT sum(balance) FROM account`).Scan(&rep.Money); err != nil {
		return err
	}
	if rep.Money != rep.WantMoney {
		rep.Violations = append(rep.Violations, fmt.Sprintf("money not conserved: %d, want %d", rep.Money, rep.WantMoney))
	}
	return nil
}

// fleet is the set of worker processes.
type fleet struct {
	bin, dir string
	env      []string
	mu       sync.Mutex
	procs    []*proc
	seq      int
}

type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *proc) alive() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

func (f *fleet) start() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seq++
	cmd := exec.Command(f.bin)
	cmd.Env = append(os.Environ(), f.env...)
	cmd.Env = append(cmd.Env, "DEDUP_COUNTS_FILE="+filepath.Join(f.dir, "counts-"+strconv.Itoa(f.seq)+".json"))
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start worker: %w", err)
	}
	p := &proc{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	f.procs = append(f.procs, p)
	return nil
}

// keep replaces workers that exited (a worker started while PostgreSQL was
// down exits at its migration) until ctx is done.
func (f *fleet) keep(ctx context.Context, n int) {
	for sleep(ctx, time.Second) {
		f.mu.Lock()
		alive := f.procs[:0]
		for _, p := range f.procs {
			if p.alive() {
				alive = append(alive, p)
			}
		}
		f.procs = alive
		missing := n - len(alive)
		f.mu.Unlock()
		for range missing {
			_ = f.start()
		}
	}
}

func (f *fleet) killOne() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.procs) == 0 {
		return errors.New("no worker to kill")
	}
	i := rand.IntN(len(f.procs))
	p := f.procs[i]
	f.procs = append(f.procs[:i], f.procs[i+1:]...)
	return p.cmd.Process.Signal(syscall.SIGKILL)
}

func (f *fleet) stopAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, p := range f.procs {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	timeout := time.After(15 * time.Second)
	for _, p := range f.procs {
		select {
		case <-p.done:
		case <-timeout:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
	f.procs = nil
}

// counts sums the outcome counts every worker process wrote.
func (f *fleet) counts() (map[string]int64, error) {
	files, err := filepath.Glob(filepath.Join(f.dir, "counts-*.json"))
	if err != nil {
		return nil, err
	}
	total := map[string]int64{}
	for _, file := range files {
		raw, err := os.ReadFile(file)
		if err != nil {
			return nil, err
		}
		var c map[string]int64
		if err := json.Unmarshal(raw, &c); err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		for k, v := range c {
			total[k] += v
		}
	}
	return total, nil
}

func jitter(mean time.Duration) time.Duration {
	return mean/2 + time.Duration(rand.Int64N(int64(mean)))
}

// sleep waits d or until ctx is done; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
