package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cpuMeter reads the CPU time used so far by the PostgreSQL server (its
// postmaster and the postmaster's children, from /proc) and by this process,
// so that each approach's cost can be split between the database and the
// client. With a server that is not local (BENCH_DATABASE_URL), only the
// client side is known.
type cpuMeter struct {
	postmaster int // 0: server CPU unknown
}

// newCPUMeter finds the postmaster of the cluster in dataDir ("" for none).
func newCPUMeter(dataDir string) cpuMeter {
	if dataDir == "" {
		return cpuMeter{}
	}
	raw, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return cpuMeter{}
	}
	pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(raw), "\n", 2)[0]))
	if err != nil {
		return cpuMeter{}
	}
	return cpuMeter{postmaster: pid}
}

// machineBusy returns the CPU time the machine has used since boot, from
// /proc/stat (all CPUs' user, nice, system, irq and softirq time; not
// steal, which other guests of the host used); -1 when unknown.
func machineBusy() time.Duration {
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		return -1
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	if len(f) < 8 || f[0] != "cpu" {
		return -1
	}
	var ticks int64
	for _, i := range []int{1, 2, 3, 6, 7} {
		n, _ := strconv.ParseInt(f[i], 10, 64)
		ticks += n
	}
	return time.Duration(ticks) * time.Second / userHZ
}

// userHZ is the unit of the CPU times in /proc/<pid>/stat on Linux.
const userHZ = 100

// read returns the server's and this process's CPU time so far; server is
// -1 when unknown. The server's is the live processes' (the postmaster and
// its children) plus the postmaster's cutime and cstime: the CPU time of
// the children it has reaped. So a process that exits between two reads
// (an autovacuum worker, a backend the pool closed) is counted in full,
// rather than left out, or subtracted when it was alive at the first read.
func (m cpuMeter) read() (server, client time.Duration) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err == nil {
		client = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	if m.postmaster == 0 {
		return -1, client
	}
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var ticks int64
	for _, p := range stats {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue // the process exited
		}
		s := string(raw)
		end := strings.LastIndexByte(s, ')') // the command name may hold spaces
		if end < 0 || end+2 >= len(s) {
			continue
		}
		pid, _ := strconv.Atoi(strings.TrimSpace(s[:strings.IndexByte(s, ' ')]))
		f := strings.Fields(s[end+2:]) // f[0] is field 3 (state)
		if len(f) < 15 {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		if pid != m.postmaster && ppid != m.postmaster {
			continue
		}
		utime, _ := strconv.ParseInt(f[11], 10, 64) // field 14
		stime, _ := strconv.ParseInt(f[12], 10, 64) // field 15
		ticks += utime + stime
		if pid == m.postmaster {
			cutime, _ := strconv.ParseInt(f[13], 10, 64) // field 16: reaped children
			cstime, _ := strconv.ParseInt(f[14], 10, 64) // field 17
			ticks += cutime + cstime
		}
	}
	return time.Duration(ticks) * time.Second / userHZ, client
}
