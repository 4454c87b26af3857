// Command chaos runs the ledger example under faults (see internal/chaos):
// several worker processes on a real Temporal dev server and PostgreSQL,
// with SIGKILLed workers, terminated backends, forced redeliveries and a
// PostgreSQL restart. It prints what happened and exits non-zero if any
// transfer was applied twice or lost, or money was not conserved.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/dedupactivity/dedupactivity/internal/chaos"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(1)
	}
}

func run() error {
	var cfg chaos.Config
	flag.DurationVar(&cfg.Duration, "duration", 100*time.Second, "length of the fault phase")
	flag.IntVar(&cfg.Workers, "workers", 3, "worker processes")
	flag.Float64Var(&cfg.Rate, "rate", 8, "workflows started per second")
	flag.DurationVar(&cfg.KillEvery, "kill-every", 6*time.Second, "mean interval between worker SIGKILLs")
	flag.DurationVar(&cfg.TerminateEvery, "terminate-every", 1500*time.Millisecond, "mean interval between pg_terminate_backend calls")
	flag.BoolVar(&cfg.RestartPostgres, "restart-postgres", true, "restart PostgreSQL once, half way")
	flag.DurationVar(&cfg.Drain, "drain", 5*time.Minute, "how long to wait for workflows after the fault phase")
	flag.Parse()
	cfg.Log = os.Stdout

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	rep, err := chaos.Run(ctx, cfg)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\nwhat\tcount\t")
	row := func(k string, v any) { fmt.Fprintf(tw, "%s\t%v\t\n", k, v) }
	row("workflows started", rep.Started)
	row("workflows completed", rep.Completed)
	row("workflows failed", rep.Failed)
	outcomes := make([]string, 0, len(rep.Attempts))
	for o := range rep.Attempts {
		outcomes = append(outcomes, o)
	}
	slices.Sort(outcomes)
	for _, o := range outcomes {
		row("attempts: "+o+" (at least)", rep.Attempts[o])
	}
	row("effects applied", rep.Effects)
	row("effects expected", rep.Expected)
	row("double effects", rep.Doubles)
	row("lost effects", rep.Lost)
	row("receipts not matching ledger", rep.Mismatched)
	row("money", fmt.Sprintf("%d (want %d)", rep.Money, rep.WantMoney))
	row("faults: workers SIGKILLed", rep.Kills)
	row("faults: backends terminated", rep.Terminations)
	row("faults: PostgreSQL restarts", rep.Restarts)
	row("faults: lost completions, overlapping attempts", "every 4th / 7th transfer")
	tw.Flush()
	fmt.Printf("took %s\n", rep.Took.Round(time.Second))
	if !rep.OK() {
		fmt.Println("\nVIOLATIONS:")
		for _, v := range rep.Violations {
			fmt.Println("  -", v)
		}
		return fmt.Errorf("%d violations", len(rep.Violations))
	}
	fmt.Println("\nALL INVARIANTS HOLD: nothing applied twice, nothing lost, money conserved")
	return nil
}
