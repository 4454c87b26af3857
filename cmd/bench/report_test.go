package main

import (
	"strings"
	"testing"
	"time"
)

// testReport is a report with made-up cells at concurrency 8: approach name
// delivered rates[name] events in one second, with cpu[name] of server CPU
// and no client CPU.
func testReport(rates map[string]float64, cpu map[string]time.Duration) *report {
	r := &report{cfg: config{levels: []int{8}, markers: 100}}
	for name, perSec := range rates {
		r.cells = append(r.cells, &cell{
			approach:  name,
			conc:      8,
			events:    int(perSec),
			elapsed:   time.Second,
			serverCPU: cpu[name],
			clientCPU: 0,
		})
	}
	r.roundTrips = []roundTrips{{nameBare, 4, 4}, {nameDedup, 4, 2}}
	r.doubles = []doubles{{nameDedup, 0, 0}}
	r.firstP50, r.dupP50 = 2*time.Millisecond, time.Millisecond
	r.emptyP50, r.fullP50 = 10*time.Millisecond, 13*time.Millisecond
	return r
}

func TestTargetsVerdicts(t *testing.T) {
	t.Parallel()
	r := testReport(map[string]float64{
		nameBare: 1000, nameDedup: 950, nameSeed: 900, nameFloor: 990,
	}, nil)
	var b strings.Builder
	r.targets(&b)
	out := b.String()
	for _, want := range []string{
		"| throughput >= 1.0x the seed recipe, every concurrency | 1.06x at 8 | met |",
		"| throughput >= 0.80x bare, every concurrency | 0.95x at 8 | met |",
		"| round trips per first delivery <= the bare transaction's | 4 vs 4 | met |",
		"| duplicate path cheaper than a first delivery (p50) | 1.00 vs 2.00 ms | met |",
		"| claim p50 with 100 markers <= 1.2x a small table's | 1.30x | **missed** |",
		"| zero double effects, every event delivered twice at once | 0 | met |",
		"the floor row ran at 0.99x at 8 of bare",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("targets lack %q; got:\n%s", want, out)
		}
	}

	r = testReport(map[string]float64{
		nameBare: 1000, nameDedup: 799, nameSeed: 800, nameFloor: 990,
	}, nil)
	b.Reset()
	r.targets(&b)
	out = b.String()
	for _, want := range []string{
		"| throughput >= 1.0x the seed recipe, every concurrency | 1.00x at 8 | **missed** |", // 0.99875 rounds up in print, not in the verdict
		"| throughput >= 0.80x bare, every concurrency | 0.80x at 8 | **missed** |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("targets lack %q; got:\n%s", want, out)
		}
	}
}

func TestCostBreakdown(t *testing.T) {
	t.Parallel()
	// 1000 events each; server CPU over the run, so µs/event = ms here.
	r := testReport(map[string]float64{
		nameBare: 1000, nameDedup: 1000, nameDedupKey: 1000, nameByHand: 1000, nameSeed: 1000, nameFloor: 1000,
	}, map[string]time.Duration{
		nameBare:     500 * time.Millisecond,
		nameSeed:     600 * time.Millisecond,
		nameByHand:   650 * time.Millisecond,
		nameDedup:    690 * time.Millisecond,
		nameDedupKey: 720 * time.Millisecond,
		nameFloor:    540 * time.Millisecond,
	})
	var b strings.Builder
	r.costBreakdown(&b)
	want := "| 8 | 500 | +100 (1.00x) | +150 (1.00x) | +40 (1.00x) | +30 (1.00x) | +190 (1.00x) | +40 (1.00x) |"
	if !strings.Contains(b.String(), want) {
		t.Errorf("breakdown lacks %q; got:\n%s", want, b.String())
	}

	// Unknown server CPU: no table rows rather than made-up numbers.
	r.cell(nameBare, 8).serverCPU = -1
	b.Reset()
	r.costBreakdown(&b)
	if strings.Contains(b.String(), "| 8 |") || !strings.Contains(b.String(), "Not measured") {
		t.Errorf("breakdown without the server's CPU should say it is not measured; got:\n%s", b.String())
	}
}

func TestRoundRatiosMedian(t *testing.T) {
	t.Parallel()
	r := &report{cells: []*cell{
		{approach: "a", conc: 8, perRound: []float64{10, 20, 30, 40}},
		{approach: "b", conc: 8, perRound: []float64{10, 10, 10, 10}},
	}}
	// Ratios 1, 2, 3, 4: the median of an even count is the mean of the
	// middle two.
	if med, lo, hi := r.roundRatios("a", "b", 8); med != 2.5 || lo != 1 || hi != 4 {
		t.Errorf("roundRatios = %v, %v, %v; want 2.5, 1, 4", med, lo, hi)
	}
	if got := medianOf([]float64{1, 2, 3}); got != 2 {
		t.Errorf("medianOf(1, 2, 3) = %v, want 2", got)
	}
}

func TestTemporalSection(t *testing.T) {
	t.Parallel()
	tr := temporalResult{bare: 400, wrapped: 392, ratios: []float64{0.9, 0.98, 1.1}, activities: 400, rounds: 3,
		cpu: map[string]*temporalCPU{
			"Bare":    {server: 300 * time.Millisecond, client: 900 * time.Millisecond, rest: 3 * time.Second, cpuKnown: true, activities: 1000, events: 3880},
			"Wrapped": {server: 350 * time.Millisecond, client: 920 * time.Millisecond, rest: 3 * time.Second, cpuKnown: true, activities: 1000, events: 3900},
		}}
	out := tr.markdown()
	for _, want := range []string{
		"| unwrapped (effect in a transaction) | 400 | 300 µs | 900 µs | 3000 µs | 4200 µs | 3.88 |",
		"| wrapped by dedupactivity | 392 (0.98x) | 350 µs | 920 µs | 3000 µs | 4270 µs | 3.90 |",
		"median 0.98x, range 0.90x to 1.10x",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
}

// TestTemporalCPUAdd: the rest is the machine's CPU time that neither
// PostgreSQL nor this process used; a measurement whose CPU could not be
// read (a server not on this machine) leaves the CPU unknown, its
// activities and events still counted.
func TestTemporalCPUAdd(t *testing.T) {
	t.Parallel()
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	var c temporalCPU
	c.add(400, 1552, cpuReading{ms(1000), ms(2000), ms(10000)}, cpuReading{ms(1120), ms(2360), ms(11700)})
	c.add(400, 1560, cpuReading{ms(1120), ms(2360), ms(11700)}, cpuReading{ms(1250), ms(2730), ms(13400)})
	if want := (temporalCPU{server: ms(250), client: ms(730), rest: ms(2420), cpuKnown: true, activities: 800, events: 3112}); c != want {
		t.Errorf("got %+v, want %+v", c, want)
	}
	if s, cl, r := c.perActivity(); s != 312.5 || cl != 912.5 || r != 3025 {
		t.Errorf("per activity: %v %v %v µs", s, cl, r)
	}
	c.add(400, 1550, cpuReading{-1, ms(2730), ms(13400)}, cpuReading{-1, ms(3000), ms(15000)})
	if c.cpuKnown || c.activities != 1200 || c.events != 4662 {
		t.Errorf("after a measurement without the server's CPU: %+v", c)
	}
	tr := temporalResult{bare: 1, wrapped: 1, ratios: []float64{1}, cpu: map[string]*temporalCPU{"Bare": &c, "Wrapped": &c}}
	if out := tr.markdown(); !strings.Contains(out, "| unwrapped (effect in a transaction) | 1 |  |  |  |  | 3.88 |") {
		t.Errorf("CPU unknown: %s", out)
	}
}
