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
	r.roundTrips = []roundTrips{{"bare", 4, 4}, {"dedupactivity", 4, 2}}
	r.doubles = []doubles{{"dedupactivity", 0, 0}}
	r.firstP50, r.dupP50 = 2*time.Millisecond, time.Millisecond
	r.emptyP50, r.fullP50 = 10*time.Millisecond, 13*time.Millisecond
	return r
}

func TestTargetsVerdicts(t *testing.T) {
	t.Parallel()
	r := testReport(map[string]float64{
		"bare": 1000, "dedupactivity": 950, "status-record": 500, nameFloor: 990,
	}, nil)
	var b strings.Builder
	r.targets(&b)
	out := b.String()
	for _, want := range []string{
		"| throughput >= 0.9x bare, every concurrency | 0.95x at 8 | met |",
		"| throughput >= 1.5x status-record, every concurrency | 1.90x at 8 | met |",
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
		"bare": 1000, "dedupactivity": 899, "status-record": 600, nameFloor: 990,
	}, nil)
	b.Reset()
	r.targets(&b)
	out = b.String()
	for _, want := range []string{
		"| throughput >= 0.9x bare, every concurrency | 0.90x at 8 | **missed** |", // 0.899 rounds up in print, not in the verdict
		"| throughput >= 1.5x status-record, every concurrency | 1.50x at 8 | **missed** |",
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
		"bare": 1000, "dedupactivity": 1000, nameByHand: 1000, nameLockOnly: 1000, nameMarkerOnly: 1000, nameFloor: 1000,
	}, map[string]time.Duration{
		"bare":          500 * time.Millisecond,
		nameLockOnly:    600 * time.Millisecond,
		nameMarkerOnly:  650 * time.Millisecond,
		nameByHand:      750 * time.Millisecond,
		"dedupactivity": 790 * time.Millisecond,
		nameFloor:       540 * time.Millisecond,
	})
	var b strings.Builder
	r.costBreakdown(&b)
	want := "| 8 | 500 | +100 (1.00x) | +150 (1.00x) | +250 (1.00x) | +40 (1.00x) | +290 (1.00x) | +40 (1.00x) |"
	if !strings.Contains(b.String(), want) {
		t.Errorf("breakdown lacks %q; got:\n%s", want, b.String())
	}

	// Unknown server CPU: no table rows rather than made-up numbers.
	r.cell("bare", 8).serverCPU = -1
	b.Reset()
	r.costBreakdown(&b)
	if strings.Contains(b.String(), "| 8 |") || !strings.Contains(b.String(), "Not measured") {
		t.Errorf("breakdown without the server's CPU should say it is not measured; got:\n%s", b.String())
	}
}
