// Command demo is the project's main job: it runs transfer workflows with
// injected redeliveries (lost completions, overlapping attempts, a lost
// receipt acknowledgement) on a real PostgreSQL and a real Temporal server,
// then prints what each attempt did and checks the ledger: money conserved,
// each transfer applied once, one receipt each at the receipts service, and
// the faults seen to fire.
//
// With no configuration it starts a throwaway PostgreSQL cluster from the
// local binaries and a Temporal dev server (from bin/temporal or PATH); set
// DATABASE_URL or TEMPORAL_ADDRESS to use your own. DATABASE_URL must name a
// database of its own: the demo's relay sends whatever the outbox table
// there holds, its checks count the whole table, and it creates a receipts
// database beside it (which needs CREATEDB). It exits non-zero if the
// invariant fails.
package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"math/big"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.temporal.io/sdk/client"
	tlog "go.temporal.io/sdk/log"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/internal/ledgerworker"
	"github.com/dedupactivity/dedupactivity/internal/obstest"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/receipts"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
	"github.com/dedupactivity/dedupactivity/workflows"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

type config struct {
	workflows    int
	accounts     int
	balance      int64
	lostEvery    int
	stallEvery   int
	stall        time.Duration
	startToClose time.Duration
}

func run() error {
	var cfg config
	flag.IntVar(&cfg.workflows, "workflows", 60, "transfer workflows to run")
	flag.IntVar(&cfg.accounts, "accounts", 100, "accounts to transfer between (fewer means more lock contention between transfers)")
	flag.Int64Var(&cfg.balance, "balance", 10_000, "opening balance of each account")
	flag.IntVar(&cfg.lostEvery, "lost-every", 3, "every Nth transfer loses its debit's first completion (0: never)")
	flag.IntVar(&cfg.stallEvery, "stall-every", 5, "every Nth transfer's credit outlives its StartToClose timeout on its first attempt (0: never)")
	flag.DurationVar(&cfg.stall, "stall", 2500*time.Millisecond, "how long a stalled first attempt sleeps inside its transaction")
	flag.DurationVar(&cfg.startToClose, "start-to-close", 2*time.Second, "StartToClose timeout of each activity attempt")
	traces := flag.Bool("traces", false, "start Jaeger v2 (bin/jaeger, make jaeger) beside the dev server, export the worker's spans to it over OTLP, and print a redelivered transfer's trace and what Jaeger holds")
	hold := flag.Bool("hold", false, "keep the servers the demo started (the Temporal dev server and its Web UI, Jaeger with -traces) serving after the report until Ctrl-C")
	flag.Parse()
	if cfg.workflows < 1 || cfg.accounts < 2 {
		return errors.New("-workflows must be >= 1 and -accounts >= 2")
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	began := time.Now()

	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		fmt.Println("starting a throwaway PostgreSQL cluster from the local binaries ...")
		c, err := pgtest.StartCluster()
		if err != nil {
			return fmt.Errorf("start PostgreSQL (or set DATABASE_URL): %w", err)
		}
		defer c.Destroy() // best effort at exit
		dbURL = c.URL()
	}

	temporalAddr := os.Getenv("TEMPORAL_ADDRESS")
	if temporalAddr == "" {
		fmt.Println("starting a Temporal dev server ...")
		uiPort, err := pgtest.FreePort()
		if err != nil {
			return err
		}
		srv, err := temporaltest.Start(ctx, temporaltest.Options{EnableUI: true, UIPort: strconv.Itoa(uiPort)})
		if err != nil {
			return fmt.Errorf("start Temporal dev server (or set TEMPORAL_ADDRESS; make temporal-cli builds the CLI): %w", err)
		}
		defer srv.Stop() // best effort at exit
		temporalAddr = srv.Address
		fmt.Printf("Temporal Web UI: %s/namespaces/default/workflows (until the demo exits; -hold keeps it)\n", srv.UIAddress)
	} else {
		fmt.Printf("Temporal server: %s (Web UI: wherever yours runs)\n", temporalAddr)
	}

	// The demo reads its attempt counts from the library's own metrics.
	// Traces go to Jaeger under -traces, else wherever the OTEL_* variables
	// say (nowhere by default).
	var jaeger *obstest.Jaeger
	var envTel *ledgerworker.Telemetry
	var err error
	if *traces {
		path, err := obstest.Find("jaeger")
		if err != nil {
			return err
		}
		fmt.Println("starting Jaeger v2 ...")
		if jaeger, err = obstest.StartJaeger(path); err != nil {
			return err
		}
		defer jaeger.Stop() // best effort at exit
		fmt.Printf("Jaeger: OTLP in at %s, query API at %s/api\n", jaeger.OTLPEndpoint, jaeger.QueryURL)
		envTel, err = ledgerworker.NewTelemetry(ctx, ledgerworker.TelemetryConfig{ServiceName: demoService, TracesEndpoint: jaeger.OTLPEndpoint})
		if err != nil {
			return err
		}
	} else if envTel, err = ledgerworker.TelemetryFromEnv(ctx, demoService); err != nil {
		return err
	}
	defer envTel.Shutdown(context.WithoutCancel(ctx)) // best effort at exit
	reader := sdkmetric.NewManualReader()
	tel := &ledgerworker.Telemetry{
		TracerProvider: envTel.TracerProvider,
		MeterProvider:  sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
	}
	fmt.Println("starting the receipts service (its own process and database) ...")
	rs, err := startReceipts(ctx, dbURL)
	if err != nil {
		return err
	}
	defer rs.Stop()
	fmt.Printf("receipts service: %s\n", rs.URL)

	taskQueue := "demo-" + randomHex()
	w, err := ledgerworker.Start(ctx, ledgerworker.Config{
		ReceiptsURL:     rs.URL,
		TemporalAddress: temporalAddr,
		Namespace:       cmp.Or(os.Getenv("TEMPORAL_NAMESPACE"), ledgerworker.DefaultNamespace),
		TaskQueue:       taskQueue,
		DatabaseURL:     dbURL,
		Logger:          tlog.NewStructuredLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError + 4}))),
	}, tel)
	if err != nil {
		return err
	}
	defer w.Stop()
	// The task queue is this run's own: its Schedules would outlive it
	// on a shared Temporal server (TEMPORAL_ADDRESS).
	defer func() {
		for _, id := range ledgerworker.ScheduleIDs(taskQueue) {
			h := w.Client.ScheduleClient().GetHandle(context.WithoutCancel(ctx), id)
			if err := h.Delete(context.WithoutCancel(ctx)); err != nil {
				fmt.Fprintf(os.Stderr, "demo: delete schedule %s: %v\n", id, err)
			}
		}
	}()

	accounts := make([]string, cfg.accounts)
	for i := range accounts {
		accounts[i] = fmt.Sprintf("demo-%s-%02d", taskQueue[5:], i)
	}
	if err := activities.OpenAccounts(ctx, w.Pool, cfg.balance, accounts...); err != nil {
		return err
	}

	fmt.Printf("running %d transfer workflows on task queue %s (lost completion every %d, overlapping attempt every %d)\n",
		cfg.workflows, taskQueue, cfg.lostEvery, cfg.stallEvery)
	results := runTransfers(ctx, w.Client, taskQueue, accounts, cfg)

	// Let the relay deliver what the last transfers enqueued. Then lose
	// one acknowledgement, as a relay that dies after sending would: the
	// receipt is sent again with its key, and the receipts service must
	// replay its answer instead of storing a second receipt.
	drain := func() {
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			st, err := w.Outbox.Stats(ctx)
			if err == nil && st.Pending+st.Sending == 0 {
				return
			}
		}
	}
	drain()
	lostAck, err := loseAcknowledgement(ctx, w.Pool, results)
	if err != nil {
		return err
	}
	drain()
	reportErr := report(ctx, w, rs, reader, accounts, cfg, results, lostAck, time.Since(began))
	if jaeger != nil {
		if err := showTraces(ctx, jaeger, envTel, cfg.workflows); err != nil {
			return errors.Join(reportErr, err)
		}
	}
	if *hold && reportErr == nil {
		fmt.Println("the servers the demo started keep serving; Ctrl-C to stop")
		<-ctx.Done()
	}
	return reportErr
}

const demoService = "ledger-demo"

// showTraces flushes the spans and prints one redelivered debit's trace and
// a line on what Jaeger holds, both read back from Jaeger's HTTP API.
func showTraces(ctx context.Context, j *obstest.Jaeger, tel *ledgerworker.Telemetry, workflows int) error {
	if tp, ok := tel.TracerProvider.(*sdktrace.TracerProvider); ok {
		if err := tp.ForceFlush(ctx); err != nil {
			return fmt.Errorf("flush spans: %w", err)
		}
	}
	var id string
	deadline := time.Now().Add(20 * time.Second)
	for {
		found, err := j.Traces(ctx, demoService, map[string]string{"dedup.outcome": "duplicate"}, workflows)
		if err != nil {
			return fmt.Errorf("jaeger: %w", err)
		}
		var ok bool
		if id, ok = obstest.RedeliveredTrace(found, activities.DebitName); ok || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	// Every trace the run left: its workflows, their activities, and the
	// relay's and pruner's own, which can outnumber the workflows many
	// times; fewer could leave out the redelivered ones.
	summary, err := j.Summary(ctx, demoService, 1000)
	if err != nil {
		return fmt.Errorf("jaeger: %w", err)
	}
	fmt.Println(summary)
	if id == "" {
		return errors.New("jaeger holds no trace with a claimed and a duplicate debit")
	}
	fmt.Printf("a debit delivered twice, applied once (RunActivity:Debit with a claimed and a duplicate Dedup child): %s/api/traces/%s\n", j.QueryURL, id)
	fmt.Println("(Jaeger's web UI is not in the Go module: the page at / is a placeholder, so the link is the trace's JSON)")
	return nil
}

type outcome struct {
	req workflows.TransferRequest
	res workflows.TransferResult
	err error
}

func runTransfers(ctx context.Context, c client.Client, taskQueue string, accounts []string, cfg config) []outcome {
	out := make([]outcome, cfg.workflows)
	var done atomic.Int64
	var wg sync.WaitGroup
	prefix := randomHex()
	for i := range cfg.workflows {
		from := randInt(len(accounts))
		to := (from + 1 + randInt(len(accounts)-1)) % len(accounts)
		req := workflows.TransferRequest{
			TransferID:   fmt.Sprintf("transfer-%s-%03d", prefix, i),
			From:         accounts[from],
			To:           accounts[to],
			Amount:       int64(1 + randInt(100)),
			StartToClose: cfg.startToClose,
		}
		if cfg.lostEvery > 0 && i%cfg.lostEvery == 0 {
			req.Faults.LoseCompletion = true
		}
		if cfg.stallEvery > 0 && i%cfg.stallEvery == 1%cfg.stallEvery {
			req.Faults.StallCredit = cfg.stall
		}
		out[i].req = req
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer done.Add(1)
			run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: req.TransferID, TaskQueue: taskQueue}, workflows.TransferWorkflowName, req)
			if err != nil {
				out[i].err = err
				return
			}
			out[i].err = run.Get(ctx, &out[i].res)
		}()
	}
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-finished:
			fmt.Printf("  %d/%d workflows finished\n", done.Load(), cfg.workflows)
			return out
		case <-tick.C:
			fmt.Printf("  %d/%d workflows finished\n", done.Load(), cfg.workflows)
		}
	}
}

func report(ctx context.Context, w *ledgerworker.Worker, rs *receiptsService, reader *sdkmetric.ManualReader, accounts []string, cfg config, results []outcome, lostAck int64, took time.Duration) error {
	pool := w.Pool
	byOutcome, err := ledgerworker.Counts(ctx, reader)
	if err != nil {
		return err
	}
	var attempts int64
	for _, n := range byOutcome {
		attempts += n
	}

	completed, failed := 0, 0
	var problems []string
	for _, r := range results {
		if r.err != nil {
			failed++
			problems = append(problems, fmt.Sprintf("workflow %s failed: %v", r.req.TransferID, r.err))
			continue
		}
		completed++
	}

	// The ledger, read back: every completed transfer has exactly one debit
	// and one credit, and they are the entries the workflow was handed.
	var rows, total int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entry WHERE account = ANY($1)`, accounts).Scan(&rows); err != nil {
		return err
	}
	if err := pool.QueryRow(ctx, `SELECT sum(balance) FROM account WHERE id = ANY($1)`, accounts).Scan(&total); err != nil {
		return err
	}
	ids := make([]string, len(results))
	for i, r := range results {
		ids[i] = r.req.TransferID
	}
	ledger, err := activities.Audit(ctx, pool, ids)
	if err != nil {
		return err
	}
	doubles := 0
	for _, r := range results {
		problem, double := ledger[r.req.TransferID].Check(r.req.TransferID, r.err == nil, r.res.Debit, r.res.Credit)
		if double {
			doubles++
		}
		if problem != "" {
			problems = append(problems, problem)
		}
	}
	// The receipts service's own database: every completed transfer has
	// exactly one receipt there.
	st, err := w.Outbox.Stats(ctx)
	if err != nil {
		return err
	}
	receiptCounts, err := receipts.Counts(ctx, rs.Pool, ids)
	if err != nil {
		return err
	}
	receiptsApplied := 0
	for _, r := range results {
		n := receiptCounts[r.req.TransferID]
		receiptsApplied += n
		switch {
		case n > 1:
			problems = append(problems, fmt.Sprintf("%s: %d receipts at the destination", r.req.TransferID, n))
		case r.err == nil && n != 1:
			problems = append(problems, fmt.Sprintf("%s completed but has %d receipts at the destination", r.req.TransferID, n))
		}
	}
	if st.Dead > 0 || st.Rejected > 0 {
		problems = append(problems, fmt.Sprintf("%d dead and %d rejected messages in the outbox", st.Dead, st.Rejected))
	}
	want := cfg.balance * int64(len(accounts))
	if total != want {
		problems = append(problems, fmt.Sprintf("money not conserved: balances sum to %d, want %d", total, want))
	}

	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\nwhat\tcount\t")
	fmt.Fprintf(tw, "workflows started\t%d\t\n", len(results))
	fmt.Fprintf(tw, "workflows completed\t%d\t\n", completed)
	fmt.Fprintf(tw, "workflows failed\t%d\t\n", failed)
	var lostIDs []string
	stalled := 0
	for _, r := range results {
		if r.req.Faults.LoseCompletion {
			lostIDs = append(lostIDs, r.req.TransferID)
		}
		if r.req.Faults.StallCredit > 0 {
			stalled++
		}
	}
	// A debit's lost completion fires only if its first attempt committed:
	// one that waited past its StartToClose timeout (on the row lock of a
	// stalled credit's account, say) rolled back, and its retry is a first
	// claim. The ledger says which committed.
	var lostFired int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM ledger_entry WHERE kind = 'debit' AND attempt = 1 AND transfer_id = ANY($1)`, lostIDs).Scan(&lostFired); err != nil {
		return err
	}
	// The faults must have fired, or the invariant proves nothing: each
	// debit whose first attempt committed and lost its completion was
	// redelivered and found a duplicate, and the receipt whose
	// acknowledgement was lost was sent again.
	switch dups := byOutcome[string(dedupactivity.OutcomeDuplicate)]; {
	case dups < lostFired:
		problems = append(problems, fmt.Sprintf("%d debits committed and lost their completion, but only %d duplicates were seen", lostFired, dups))
	case len(lostIDs) > 0 && lostFired == 0:
		problems = append(problems, fmt.Sprintf("none of the %d debits set to lose their completion committed at their first attempt: the fault did not fire", len(lostIDs)))
	}
	lostAcks := 0
	switch {
	case lostAck != 0:
		lostAcks = 1
		var attempts int
		var state string
		if err := pool.QueryRow(ctx, `SELECT attempts, state FROM dedup_outbox WHERE id = $1`, lostAck).Scan(&attempts, &state); err != nil {
			return err
		}
		if attempts < 2 || state != string(outbox.StateSent) {
			problems = append(problems, fmt.Sprintf("the receipt whose acknowledgement was lost was not sent again and acknowledged (%d sends, %s)", attempts, state))
		}
	case completed > 0:
		problems = append(problems, "no receipt was acknowledged, so none could lose its acknowledgement")
	}
	// As the chaos report says it: of the debits set to lose their
	// completion, those whose first attempt committed.
	fmt.Fprintf(tw, "injected: lost completions (debit committed at attempt 1)\t%d of %d\t\n", lostFired, len(lostIDs))
	fmt.Fprintf(tw, "injected: overlapping attempts (credits set to stall)\t%d\t\n", stalled)
	fmt.Fprintf(tw, "injected: lost receipt acknowledgements\t%d\t\n", lostAcks)
	fmt.Fprintf(tw, "activity attempts\t%d\t\n", attempts)
	for _, o := range []dedupactivity.Outcome{dedupactivity.OutcomeClaimed, dedupactivity.OutcomeDuplicate, dedupactivity.OutcomePayloadMismatch,
		dedupactivity.OutcomeEffectError, dedupactivity.OutcomeClaimTimeout, dedupactivity.OutcomeError} {
		fmt.Fprintf(tw, "  %s\t%d\t\n", o, byOutcome[string(o)])
	}
	fmt.Fprintf(tw, "ledger rows\t%d\t\n", rows)
	fmt.Fprintf(tw, "transfers applied twice\t%d\t\n", doubles)
	fmt.Fprintf(tw, "money (sum of balances)\t%d\t\n", total)
	fmt.Fprintf(tw, "outbox: receipts enqueued\t%d\t\n", st.Enqueued())
	fmt.Fprintf(tw, "outbox: sent (acknowledged)\t%d\t\n", st.Sent)
	fmt.Fprintf(tw, "outbox: re-sent\t%d\t\n", st.Resends)
	fmt.Fprintf(tw, "outbox: settled by reconciler\t%d\t\n", st.Applied)
	fmt.Fprintf(tw, "outbox: pending\t%d\t\n", st.Pending+st.Sending)
	fmt.Fprintf(tw, "outbox: dead\t%d\t\n", st.Dead)
	fmt.Fprintf(tw, "outbox: rejected by the destination\t%d\t\n", st.Rejected)
	fmt.Fprintf(tw, "receipts applied at destination\t%d\t\n", receiptsApplied)
	tw.Flush()
	fmt.Println("(an attempt that outlived its StartToClose timeout fails when it tries to commit: counted as error or effect_error, rolled back)")
	fmt.Printf("took %s\n", took.Round(100*time.Millisecond))

	if len(problems) > 0 {
		fmt.Println("\nINVARIANT FAILED:")
		for _, p := range problems {
			fmt.Println("  -", p)
		}
		return errors.New("invariant failed")
	}
	fmt.Printf("\nINVARIANT HOLDS: money conserved (%d), each of %d transfers applied exactly once (%d ledger rows), %d redelivered attempts returned the stored result, each completed transfer has exactly one receipt at the destination (%d, %d of them sent again)\n",
		total, completed, rows, byOutcome[string(dedupactivity.OutcomeDuplicate)], receiptsApplied, st.Resends)
	return nil
}

// loseAcknowledgement makes the receipt of one completed transfer due
// again, as if its relay had died after sending it: the relay sends it
// again with the same key. It returns the message's ID, 0 if there was no
// acknowledged receipt to take.
func loseAcknowledgement(ctx context.Context, pool *pgxpool.Pool, results []outcome) (int64, error) {
	var ids []string
	for _, r := range results {
		if r.err == nil {
			ids = append(ids, r.req.TransferID)
		}
	}
	var id int64
	err := pool.QueryRow(ctx, `UPDATE dedup_outbox SET state = 'pending', next_attempt_at = now(), settled_at = NULL
WHERE id = (SELECT min(id) FROM dedup_outbox WHERE state = 'sent' AND convert_from(payload, 'UTF8')::jsonb ->> 'TransferID' = ANY($1))
RETURNING id`, ids).Scan(&id)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("lose a receipt's acknowledgement: %w", err)
	}
	return id, nil
}

func randInt(n int) int {
	v, err := rand.Int(rand.Reader, big.NewInt(int64(n)))
	if err != nil {
		log.Fatal(err)
	}
	return int(v.Int64())
}

func randomHex() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
