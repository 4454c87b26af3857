package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
)

// report is what a run saw and checked.
type report struct {
	Started, Completed, Failed int
	Attempts                   map[string]int64 // by dedup outcome (lower bounds: see ledgerworker.CountsToFile)
	Effects, Expected          int64            // ledger rows, and 2 per completed transfer
	Doubles, Lost              int              // transfers applied twice; completed transfers missing an effect
	Mismatched                 int              // ledger entries not matching the workflow's result
	Money, WantMoney           int64
	// LostCompletions is how many completed transfers were set to lose
	// their debit's first completion; LostCompletionsFired how many of
	// those the ledger shows committed at attempt 1, so that a later
	// attempt returned the stored receipt (a first attempt that waited
	// past its StartToClose on a row lock rolled back: its retry was a
	// first claim, and the fault did not fire).
	LostCompletions, LostCompletionsFired int64
	Stalled                               int // transfers whose first credit attempt was set to outlive its StartToClose

	// The outbox (the ledger's database), counted with SQL after the drain.
	Enqueued, Sent, Settled, Resent, Dead, Rejected, Unsettled int64 // Settled: marked applied by a reconciler
	// The destination (the receipts database), counted with SQL.
	ReceiptsApplied int64 // receipt rows
	ReceiptsDouble  int   // keys or transfers with more than one receipt
	ReceiptsLost    int   // messages, or completed transfers, without a receipt

	Faults     *faults
	Proxy      proxyCounts
	Reconciled outbox.ReconcileReport // the drain's reconciler, summed
	Took       time.Duration
	Violations []string
}

// OK says whether every invariant held.
func (r *report) OK() bool { return len(r.Violations) == 0 }

func (r *report) violate(format string, args ...any) {
	r.Violations = append(r.Violations, fmt.Sprintf(format, args...))
}

// check counts, with SQL on both databases, what the run left and compares
// it with the workflows' results.
func check(ctx context.Context, r *rig, d *drained) (*report, error) {
	rep := &report{Started: len(d.runs), WantMoney: accounts * balance}
	if err := checkLedger(ctx, r, d, rep); err != nil {
		return nil, err
	}
	if err := checkReceipts(ctx, r, d, rep); err != nil {
		return nil, err
	}
	return rep, nil
}

// checkLedger: every completed transfer has exactly one debit and one credit,
// the ones its workflow returned; money is conserved.
func checkLedger(ctx context.Context, r *rig, d *drained, rep *report) error {
	ids := make([]string, len(d.runs))
	for i, t := range d.runs {
		ids[i] = t.req.TransferID
	}
	ledger, err := activities.Audit(ctx, r.ledger, ids)
	if err != nil {
		return err
	}
	var lostIDs []string
	for i, t := range d.runs {
		completed := d.errs[i] == nil
		if completed && t.req.Faults.LoseCompletion {
			lostIDs = append(lostIDs, t.req.TransferID)
		}
		if t.req.Faults.StallCredit > 0 {
			rep.Stalled++
		}
		if completed {
			rep.Completed++
			rep.Expected += 2
		} else {
			rep.Failed++
			rep.violate("workflow %s did not complete: %v", t.req.TransferID, d.errs[i])
		}
		l := ledger[t.req.TransferID]
		problem, double := l.Check(t.req.TransferID, completed, d.results[i].Debit, d.results[i].Credit)
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
	// The redeliveries must have happened, or "nothing applied twice"
	// proves nothing about them: counted with SQL, not by the workers'
	// outcome counters.
	rep.LostCompletions = int64(len(lostIDs))
	if err := r.ledger.QueryRow(ctx, `SELECT count(*) FROM ledger_entry WHERE kind = 'debit' AND attempt = 1 AND transfer_id = ANY($1)`,
		lostIDs).Scan(&rep.LostCompletionsFired); err != nil {
		return err
	}
	if rep.LostCompletions > 0 && rep.LostCompletionsFired == 0 {
		rep.violate("none of the %d completed transfers set to lose their debit's completion committed it at attempt 1: the fault did not fire", rep.LostCompletions)
	}
	if err := r.ledger.QueryRow(ctx, `SELECT count(*) FROM ledger_entry`).Scan(&rep.Effects); err != nil {
		return err
	}
	if rep.Effects != rep.Expected {
		rep.violate("%d ledger effects applied, want %d", rep.Effects, rep.Expected)
	}
	if err := r.ledger.QueryRow(ctx, `SELECT sum(balance) FROM account`).Scan(&rep.Money); err != nil {
		return err
	}
	if rep.Money != rep.WantMoney {
		rep.violate("money not conserved: %d, want %d", rep.Money, rep.WantMoney)
	}
	return nil
}

// message is an outbox row, read with SQL.
type message struct {
	key, state, transferID string
}

// checkReceipts: every message is settled (sent or applied, none dead or
// pending); every completed transfer has exactly one message and exactly
// one receipt at the destination; every message's key was applied exactly
// once there, for its transfer; no receipt exists without a message.
func checkReceipts(ctx context.Context, r *rig, d *drained, rep *report) error {
	rows, err := r.ledger.Query(ctx, `SELECT idempotency_key, state, attempts, convert_from(payload, 'UTF8')::jsonb->>'TransferID'
FROM dedup_outbox ORDER BY id`)
	if err != nil {
		return fmt.Errorf("read outbox: %w", err)
	}
	var msgs []message
	for rows.Next() {
		var m message
		var attempts int64
		if err := rows.Scan(&m.key, &m.state, &attempts, &m.transferID); err != nil {
			rows.Close()
			return err
		}
		msgs = append(msgs, m)
		rep.Enqueued++
		rep.Resent += max(attempts-1, 0)
		switch m.state {
		case "sent":
			rep.Sent++
		case "applied":
			rep.Settled++
		case "dead":
			rep.Dead++
		case "rejected":
			rep.Rejected++
		default:
			rep.Unsettled++
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read outbox: %w", err)
	}

	// The destination's own table: receipts by key and by transfer.
	byKey := map[string]int{}
	keyTransfer := map[string]string{}
	byTransfer := map[string]int{}
	rows, err = r.receipts.pool.Query(ctx, `SELECT idempotency_key, transfer_id FROM receipt`)
	if err != nil {
		return fmt.Errorf("read receipts: %w", err)
	}
	for rows.Next() {
		var key, transferID string
		if err := rows.Scan(&key, &transferID); err != nil {
			rows.Close()
			return err
		}
		rep.ReceiptsApplied++
		byKey[key]++
		keyTransfer[key] = transferID
		byTransfer[transferID]++
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read receipts: %w", err)
	}

	if rep.Dead > 0 {
		rep.violate("%d dead letters in the outbox after the destination came back", rep.Dead)
	}
	if rep.Rejected > 0 {
		rep.violate("%d messages rejected by the destination, which accepts every receipt", rep.Rejected)
	}
	if rep.Unsettled > 0 {
		rep.violate("%d messages still pending or in flight after the drain", rep.Unsettled)
	}
	messagesOf := map[string]int{}
	inOutbox := map[string]bool{}
	for _, m := range msgs {
		messagesOf[m.transferID]++
		inOutbox[m.key] = true
		switch n := byKey[m.key]; {
		case n == 0:
			rep.ReceiptsLost++
			rep.violate("message %s (%s, %s) was never applied at the destination", m.key, m.transferID, m.state)
		case n > 1:
			rep.ReceiptsDouble++
			rep.violate("message %s applied %d times at the destination", m.key, n)
		case keyTransfer[m.key] != m.transferID:
			rep.violate("message %s is for %s, the destination stored it for %s", m.key, m.transferID, keyTransfer[m.key])
		}
	}
	for key := range byKey {
		if !inOutbox[key] {
			rep.violate("receipt with key %s at the destination has no outbox message", key)
		}
	}
	for transferID, n := range byTransfer {
		if n > 1 {
			rep.ReceiptsDouble++
			rep.violate("transfer %s has %d receipts at the destination", transferID, n)
		}
	}
	for i, t := range d.runs {
		id := t.req.TransferID
		if d.errs[i] != nil {
			continue // reported by checkLedger
		}
		if n := messagesOf[id]; n != 1 {
			rep.violate("completed transfer %s has %d receipt messages in the outbox, want 1", id, n)
		}
		if byTransfer[id] == 0 {
			rep.ReceiptsLost++
			rep.violate("completed transfer %s has no receipt at the destination", id)
		}
	}
	return nil
}

// print writes the report as a table, then the verdict.
func (r *report) print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\nwhat\tcount\t")
	row := func(k string, v any) { fmt.Fprintf(tw, "%s\t%v\t\n", k, v) }
	row("workflows started", r.Started)
	row("workflows completed", r.Completed)
	row("workflows failed", r.Failed)
	outcomes := make([]string, 0, len(r.Attempts))
	for o := range r.Attempts {
		outcomes = append(outcomes, o)
	}
	slices.Sort(outcomes)
	for _, o := range outcomes {
		row("attempts: "+o+" (at least)", r.Attempts[o])
	}
	row("ledger effects applied", r.Effects)
	row("ledger effects expected", r.Expected)
	row("transfers applied twice", r.Doubles)
	row("transfers lost", r.Lost)
	row("entries not matching results", r.Mismatched)
	row("money", fmt.Sprintf("%d (want %d)", r.Money, r.WantMoney))
	row("outbox: receipts enqueued", r.Enqueued)
	row("outbox: sent (acknowledged)", r.Sent)
	row("outbox: settled by reconciler", r.Settled)
	row("outbox: re-sent (sends beyond the first)", r.Resent)
	row("outbox: dead", r.Dead)
	row("outbox: rejected", r.Rejected)
	row("outbox: pending or in flight", r.Unsettled)
	row("destination: POSTs seen by the proxy", r.Proxy.Posts)
	row("destination: POSTs of a key seen before", r.Proxy.Resends)
	row("destination: answers replayed", r.Proxy.Replayed)
	row("destination: receipts applied", r.ReceiptsApplied)
	row("destination: receipts applied twice", r.ReceiptsDouble)
	row("destination: receipts lost", r.ReceiptsLost)
	row("drain reconciler: checked / applied / re-queued", fmt.Sprintf("%d / %d / %d", r.Reconciled.Checked, r.Reconciled.Applied, r.Reconciled.Requeued))
	if f := r.Faults; f != nil {
		row("faults: workers SIGKILLed", f.Kills.Load())
		row("faults: backends terminated", f.Terminations.Load())
		row("faults: PostgreSQL restarts", f.Restarts.Load())
		row("faults: receipts service outages", f.Outages.Load())
	}
	row("faults: responses dropped after commit", r.Proxy.Dropped)
	row("faults: relays killed between send and ack", r.Proxy.RelaysKilled)
	row("faults: sends held past the lease", r.Proxy.Held)
	row("faults: overlapping sends of one key", r.Proxy.Overlapping)
	row("faults: 502s while the destination was down", r.Proxy.Unavailable)
	row("faults: lost completions (debit committed at attempt 1)", fmt.Sprintf("%d of %d", r.LostCompletionsFired, r.LostCompletions))
	row("faults: overlapping credit attempts (injected)", r.Stalled)
	tw.Flush()
	fmt.Fprintf(w, "took %s\n", r.Took.Round(time.Second))
	if !r.OK() {
		fmt.Fprintln(w, "\nVIOLATIONS:")
		for _, v := range r.Violations {
			fmt.Fprintln(w, "  -", v)
		}
		return
	}
	fmt.Fprintf(w, "\nALL INVARIANTS HOLD: nothing applied twice, nothing lost, money conserved; each of %d completed transfers has exactly one receipt at the destination (%d), no dead letters\n",
		r.Completed, r.ReceiptsApplied)
}
