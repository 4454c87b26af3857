// Package activities holds the example ledger's activities: a debit and a
// credit, each a database effect wrapped by dedupactivity so it applies once
// per event whatever Temporal redelivers.
package activities

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/migrations/ledger"
)

// Activity names: the method names, under which RegisterActivity registers
// them.
const (
	DebitName  = "Debit"
	CreditName = "Credit"
)

// Faults asks the activities to misbehave on their first attempt, so the
// demo and the tests can provoke real redeliveries.
type Faults struct {
	// LoseCompletion makes the first attempt of Debit commit its effect and
	// then report a failure, as a worker that dies before reporting would.
	LoseCompletion bool
	// StallCredit makes the first attempt of Credit sleep this long after
	// its writes, inside its claim transaction and deaf to its context, so it
	// outlives its StartToClose timeout while Temporal starts the retry.
	StallCredit time.Duration
}

// Posting is the input of Debit and Credit.
type Posting struct {
	TransferID string
	Account    string
	Amount     int64
	// Counterparty is, for Debit, the account the transfer then credits.
	// The debit checks in its transaction that it exists, so that a
	// transfer to an unknown account fails before money moves, not at its
	// credit, with the debit applied. Empty: not checked.
	Counterparty string
	Faults       Faults
}

// Receipt is what a posting returns: the ledger entry and the balance after
// it, and the attempt that applied it. A duplicate delivery returns the
// stored receipt, so Attempt can be lower than the attempt that returned it.
type Receipt struct {
	EntryID int64
	Account string
	Balance int64
	Attempt int32
}

// ReceiptsDestination is the outbox destination of transfer receipts.
const ReceiptsDestination = "receipts"

// ReceiptMessage is the receipt Credit sends, through the outbox, to the
// receipts service once a transfer's credit has been applied.
type ReceiptMessage struct {
	TransferID    string
	Account       string
	Amount        int64
	CreditEntryID int64
}

// ErrInsufficientFunds is returned by Debit when the account would go below
// zero. It reaches the workflow as a non-retryable ApplicationError of type
// "InsufficientFunds".
var ErrInsufficientFunds = errors.New("insufficient funds")

// ErrUnknownAccount is returned by Debit and Credit for an account that
// does not exist (Debit also for its Counterparty). From Debit it reaches
// the workflow as a non-retryable ApplicationError of type
// "UnknownAccount", before money moves; from Credit it is retried (see
// CreditEffect).
var ErrUnknownAccount = errors.New("unknown account")

// Error types of the activities' non-retryable ApplicationErrors.
const (
	InsufficientFundsType = "InsufficientFunds"
	UnknownAccountType    = "UnknownAccount"
)

// unknownAccount is the non-retryable error for account, which does not
// exist.
func unknownAccount(account string) error {
	// The sentinel as the one cause: errors.Is matches it in the worker,
	// and the workflow reads the message once (a wrapped cause is sent as
	// one failure per level of wrapping).
	msg := fmt.Sprintf("%v %q", ErrUnknownAccount, account)
	return temporal.NewNonRetryableApplicationError(msg, UnknownAccountType, ErrUnknownAccount)
}

// Activities holds the ledger's activities. Build it with New and register
// it as any Temporal activities struct (worker.RegisterActivity(a), with
// RegisterActivityWithOptions for a name prefix): Debit and Credit keep the
// plain activity signature, so workflows call them by method reference,
// as regular or local activities, and tests mock them with
// env.OnActivity(a.Debit, ...). Each calls its effect wrapped by
// dedupactivity, built once in New.
type Activities struct {
	debit, credit func(context.Context, Posting) (Receipt, error)
	outbox        *outbox.Outbox
}

// New returns the activities with their effects wrapped by d. When ob is
// not nil, Credit enqueues a ReceiptMessage in its transaction, for the
// receipts service.
func New(d *dedupactivity.Deduper, ob *outbox.Outbox) *Activities {
	a := &Activities{outbox: ob}
	a.debit = dedupactivity.Wrap(d, DebitEffect)
	a.credit = dedupactivity.Wrap(d, a.applyCredit)
	return a
}

// Debit takes Amount from Account, once per event however often Temporal
// delivers it. With Faults.LoseCompletion its first attempt reports a
// failure after its effect committed, as a worker that dies before
// reporting would.
func (a *Activities) Debit(ctx context.Context, in Posting) (Receipt, error) {
	r, err := a.debit(ctx, in)
	if err == nil && in.Faults.LoseCompletion && activity.GetInfo(ctx).Attempt == 1 {
		return Receipt{}, errors.New("injected fault: completion lost after commit")
	}
	return r, err
}

// Credit adds Amount to Account, once per event.
func (a *Activities) Credit(ctx context.Context, in Posting) (Receipt, error) {
	return a.credit(ctx, in)
}

// DebitEffect is Debit's effect, a dedupactivity.EffectFunc: all its writes
// go through tx.
func DebitEffect(ctx context.Context, tx pgx.Tx, in Posting) (Receipt, error) {
	if in.Counterparty != "" {
		// FOR KEY SHARE: the account cannot be deleted while the debit's
		// transaction is open (only until then: see CreditEffect).
		var found bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM account WHERE id = $1 FOR KEY SHARE)`, in.Counterparty).Scan(&found); err != nil {
			return Receipt{}, fmt.Errorf("look up account %q: %w", in.Counterparty, err)
		}
		if !found {
			return Receipt{}, unknownAccount(in.Counterparty)
		}
	}
	r, err := post(ctx, tx, in, "debit", -in.Amount)
	switch {
	case sqlState(err) == "23514": // check_violation: balance >= 0
		return r, temporal.NewNonRetryableApplicationError(ErrInsufficientFunds.Error(), InsufficientFundsType, ErrInsufficientFunds)
	case errors.Is(err, ErrUnknownAccount):
		return r, unknownAccount(in.Account)
	}
	return r, err
}

// sqlState is the SQLSTATE of a PostgreSQL error in err's chain, or "".
func sqlState(err error) string {
	var pgErr interface{ SQLState() string }
	if errors.As(err, &pgErr) {
		return pgErr.SQLState()
	}
	return ""
}

// CreditEffect is the posting of Credit's effect, a
// dedupactivity.EffectFunc. An unknown account stays a retryable error
// (ErrUnknownAccount): the transfer's debit is applied, so giving up would
// leave the money in neither account; the debit checked that the account
// existed, and one that went missing since can be opened again.
func CreditEffect(ctx context.Context, tx pgx.Tx, in Posting) (Receipt, error) {
	return post(ctx, tx, in, "credit", in.Amount)
}

// applyCredit is Credit's effect: the posting and, with an outbox, the
// receipt message, in one transaction.
func (a *Activities) applyCredit(ctx context.Context, tx pgx.Tx, in Posting) (Receipt, error) {
	r, err := CreditEffect(ctx, tx, in)
	if err == nil && a.outbox != nil {
		_, err = a.outbox.Enqueue(ctx, tx, outbox.Message{Destination: ReceiptsDestination, Name: "receipt",
			Payload: ReceiptMessage{TransferID: in.TransferID, Account: in.Account, Amount: in.Amount, CreditEntryID: r.EntryID}})
	}
	if err == nil && in.Faults.StallCredit > 0 && activity.GetInfo(ctx).Attempt == 1 {
		time.Sleep(in.Faults.StallCredit) // deliberately deaf to ctx: a zombie attempt
	}
	return r, err
}

func post(ctx context.Context, tx pgx.Tx, in Posting, kind string, delta int64) (Receipt, error) {
	r := Receipt{Account: in.Account, Attempt: activity.GetInfo(ctx).Attempt}
	if err := tx.QueryRow(ctx,
		`INSERT INTO ledger_entry (transfer_id, account, amount, kind, attempt) VALUES ($1, $2, $3, $4, $5) RETURNING id`,
		in.TransferID, in.Account, delta, kind, r.Attempt).Scan(&r.EntryID); err != nil {
		if sqlState(err) == "23503" { // foreign_key_violation: no such account
			return r, fmt.Errorf("%w %q: %w", ErrUnknownAccount, in.Account, err)
		}
		return r, fmt.Errorf("insert %s entry: %w", kind, err)
	}
	if err := tx.QueryRow(ctx,
		`UPDATE account SET balance = balance + $2 WHERE id = $1 RETURNING balance`,
		in.Account, delta).Scan(&r.Balance); err != nil {
		return r, fmt.Errorf("update balance of %q: %w", in.Account, err)
	}
	return r, nil
}

// Migrate creates the ledger schema (idempotent).
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	names, err := fs.Glob(ledger.FS, "*.up.sql")
	if err != nil {
		return err
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		sql, err := fs.ReadFile(ledger.FS, n)
		if err != nil {
			return err
		}
		b.Write(sql)
	}
	// One transaction under an advisory lock: workers may start together.
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(7245001)`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, b.String())
		return err
	})
}

// OpenAccounts creates (or resets) accounts with the given balance.
func OpenAccounts(ctx context.Context, pool *pgxpool.Pool, balance int64, ids ...string) error {
	for _, id := range ids {
		if _, err := pool.Exec(ctx,
			`INSERT INTO account (id, balance) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET balance = excluded.balance`,
			id, balance); err != nil {
			return fmt.Errorf("open account %q: %w", id, err)
		}
	}
	return nil
}

// EnsureAccounts creates, with the given balance, those of the accounts
// that do not exist yet; existing ones keep their balance, so that their
// ledger still adds up (OpenAccounts resets them).
func EnsureAccounts(ctx context.Context, pool *pgxpool.Pool, balance int64, ids ...string) error {
	if _, err := pool.Exec(ctx, `INSERT INTO account (id, balance) SELECT unnest($1::text[]), $2 ON CONFLICT (id) DO NOTHING`, ids, balance); err != nil {
		return fmt.Errorf("ensure accounts %q: %w", ids, err)
	}
	return nil
}

// TransferLedger is what the ledger holds for one transfer.
type TransferLedger struct {
	Debits, Credits   int
	DebitID, CreditID int64 // the highest entry ID of each kind; 0 if none
}

// Audit reads the ledger of the given transfers in one query.
func Audit(ctx context.Context, pool *pgxpool.Pool, transferIDs []string) (map[string]TransferLedger, error) {
	rows, err := pool.Query(ctx, `
SELECT transfer_id,
       count(*) FILTER (WHERE kind = 'debit'), count(*) FILTER (WHERE kind = 'credit'),
       coalesce(max(id) FILTER (WHERE kind = 'debit'), 0), coalesce(max(id) FILTER (WHERE kind = 'credit'), 0)
FROM ledger_entry WHERE transfer_id = ANY($1) GROUP BY transfer_id`, transferIDs)
	if err != nil {
		return nil, fmt.Errorf("audit ledger: %w", err)
	}
	defer rows.Close()
	out := make(map[string]TransferLedger, len(transferIDs))
	for rows.Next() {
		var id string
		var l TransferLedger
		if err := rows.Scan(&id, &l.Debits, &l.Credits, &l.DebitID, &l.CreditID); err != nil {
			return nil, fmt.Errorf("audit ledger: %w", err)
		}
		out[id] = l
	}
	return out, rows.Err()
}

// Check judges one transfer's ledger: applied twice is a violation whatever
// the workflow did; a completed workflow must have exactly one debit and one
// credit, and they must be the entries its receipts name. It returns what is
// wrong ("" if nothing) and whether the transfer was applied twice.
func (l TransferLedger) Check(transferID string, completed bool, debit, credit Receipt) (problem string, double bool) {
	switch {
	case l.Debits > 1 || l.Credits > 1:
		return fmt.Sprintf("%s applied twice: %d debits, %d credits", transferID, l.Debits, l.Credits), true
	case completed && (l.Debits != 1 || l.Credits != 1):
		return fmt.Sprintf("%s completed but its ledger has %d debits, %d credits", transferID, l.Debits, l.Credits), false
	case completed && (l.DebitID != debit.EntryID || l.CreditID != credit.EntryID):
		return fmt.Sprintf("%s: receipts (%d, %d) do not match the ledger (%d, %d)", transferID, debit.EntryID, credit.EntryID, l.DebitID, l.CreditID), false
	}
	return "", false
}
