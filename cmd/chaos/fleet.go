package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// proc is a child process.
type proc struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when it exited
}

func startProc(cmd *exec.Cmd) (*proc, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &proc{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	return p, nil
}

func (p *proc) alive() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// kill SIGKILLs p and waits until it has exited.
func (p *proc) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// stop sends SIGTERM and waits up to timeout, then kills.
func (p *proc) stop(timeout time.Duration) {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.kill()
	}
}

// fleet is the worker processes, one per slot. Slot i's relay reaches the
// receipts service through the proxy's port i, so the proxy knows which
// worker sent a request.
type fleet struct {
	bin, dir string
	env      func(slot int) []string
	mu       sync.Mutex
	procs    map[int]*proc
	seq      int
}

func (f *fleet) start(slot int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seq++
	cmd := exec.Command(f.bin)
	cmd.Env = append(os.Environ(), f.env(slot)...)
	cmd.Env = append(cmd.Env, "DEDUP_COUNTS_FILE="+filepath.Join(f.dir, "counts-"+strconv.Itoa(f.seq)+".json"))
	p, err := startProc(cmd)
	if err != nil {
		return fmt.Errorf("start worker: %w", err)
	}
	if f.procs == nil {
		f.procs = map[int]*proc{}
	}
	f.procs[slot] = p
	return nil
}

func (f *fleet) startAll(n int) error {
	for slot := range n {
		if err := f.start(slot); err != nil {
			return err
		}
	}
	return nil
}

// keep restarts the worker of every slot of n that has exited (killed, or
// started while PostgreSQL was down and failed its migration) until ctx is
// done.
func (f *fleet) keep(ctx context.Context, n int) {
	for sleep(ctx, time.Second) {
		for slot := range n {
			f.mu.Lock()
			p := f.procs[slot]
			f.mu.Unlock()
			if p == nil || !p.alive() {
				_ = f.start(slot)
			}
		}
	}
}

// kill SIGKILLs the worker in slot and waits for it to exit; it reports
// whether one was running. keep starts a new one.
func (f *fleet) kill(slot int) bool {
	f.mu.Lock()
	p := f.procs[slot]
	delete(f.procs, slot)
	f.mu.Unlock()
	if p == nil || !p.alive() {
		return false
	}
	p.kill()
	return true
}

// killAny SIGKILLs a random running worker and starts its replacement.
func (f *fleet) killAny() error {
	f.mu.Lock()
	slots := make([]int, 0, len(f.procs))
	for s := range f.procs {
		slots = append(slots, s)
	}
	f.mu.Unlock()
	if len(slots) == 0 {
		return errors.New("no worker to kill")
	}
	slot := slots[rand.IntN(len(slots))]
	if !f.kill(slot) {
		return errors.New("worker had already exited")
	}
	return f.start(slot)
}

func (f *fleet) stopAll() {
	f.mu.Lock()
	procs := f.procs
	f.procs = nil
	f.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range procs {
		wg.Go(func() { p.stop(15 * time.Second) })
	}
	wg.Wait()
}

// counts sums the dedup outcome counts every worker process wrote.
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
