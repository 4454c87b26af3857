// Command starter starts transfer workflows on a running worker's task queue
// (go run ./worker) and prints each result. Every third transfer loses its
// debit's first completion and every fifth credit outlives its StartToClose
// timeout, so duplicates show up in traces. Configuration: TEMPORAL_ADDRESS,
// TEMPORAL_NAMESPACE, TASK_QUEUE and DATABASE_URL (where it opens the two
// accounts it moves money between), as for the worker.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"log"
	"time"

	"go.temporal.io/sdk/client"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
	"github.com/dedupactivity/dedupactivity/workflows"
)

func main() {
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	n := flag.Int("n", 10, "transfers to start")
	flag.Parse()
	cfg, err := ledgerworker.ConfigFromEnv()
	if err != nil {
		return err
	}
	c, err := client.Dial(client.Options{HostPort: cfg.TemporalAddress, Namespace: cfg.Namespace, Logger: ledgerworker.QuietLogger()})
	if err != nil {
		return fmt.Errorf("connect to Temporal at %s: %w", cfg.TemporalAddress, err)
	}
	defer c.Close()

	ctx := context.Background()
	// The worker migrates; the starter opens the two accounts it uses.
	w, err := ledgerworker.OpenPool(ctx, cfg)
	if err != nil {
		return err
	}
	defer w.Close()
	// Opened once: a second run keeps the balances its transfers moved.
	if err := activities.EnsureAccounts(ctx, w, 1_000_000, "alice", "bob"); err != nil {
		return fmt.Errorf("open accounts (is the worker running? it creates the schema): %w", err)
	}

	b := make([]byte, 4)
	_, _ = rand.Read(b)
	for i := range *n {
		req := workflows.TransferRequest{
			TransferID: fmt.Sprintf("starter-%s-%03d", hex.EncodeToString(b), i),
			From:       "alice", To: "bob", Amount: 10,
			StartToClose: 2 * time.Second,
			Faults: activities.Faults{
				LoseCompletion: i%3 == 0,
				StallCredit:    map[bool]time.Duration{true: 2500 * time.Millisecond}[i%5 == 1],
			},
		}
		run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: req.TransferID, TaskQueue: cfg.TaskQueue}, workflows.TransferWorkflowName, req)
		if err != nil {
			return err
		}
		var res workflows.TransferResult
		if err := run.Get(ctx, &res); err != nil {
			fmt.Printf("%s failed: %v\n", req.TransferID, err)
			continue
		}
		fmt.Printf("%s: debit entry %d (applied by attempt %d), credit entry %d (applied by attempt %d)\n",
			req.TransferID, res.Debit.EntryID, res.Debit.Attempt, res.Credit.EntryID, res.Credit.Attempt)
	}
	return nil
}
