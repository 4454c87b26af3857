package dedupactivity_test

import (
	"context"
	"fmt"
	"log"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/worker"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

func ExampleDeduper_Migrate() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/app")
	if err != nil {
		log.Fatal(err)
	}
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	if err != nil {
		log.Fatal(err)
	}
	// Safe to run from every worker at start: a read-only check when the
	// table is there, an advisory lock when it creates it.
	if err := d.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
}

func ExampleRegister() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/app")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	if err != nil {
		log.Fatal(err)
	}
	c, err := client.Dial(client.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	w := worker.New(c, "ledger", worker.Options{})

	// The effect runs once per event, in the claim's transaction.
	dedupactivity.Register(w, d, "Post", func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		var p Posting
		err := tx.QueryRow(ctx,
			`UPDATE account SET balance = balance + $2 WHERE id = $1 RETURNING balance`,
			in.Account, in.Amount).Scan(&p.Balance)
		return p, err
	})
	if err := w.Run(worker.InterruptCh()); err != nil {
		log.Fatal(err)
	}
}

func ExampleWithBusinessKey() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/app")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	if err != nil {
		log.Fatal(err)
	}

	// Once per order ID, whichever workflow run delivers it.
	_ = dedupactivity.Wrap(d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2)`, in.Account, in.Amount)
		return Posting{}, err
	}, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return "order-" + in.Account, nil }))
}

// Ledger is an activities struct: Post keeps the activity signature, so the
// struct registers with RegisterActivity and workflows call Post by method
// reference; its effect is wrapped once, in NewLedger.
type Ledger struct {
	post func(context.Context, Transfer) (Posting, error)
}

func NewLedger(d *dedupactivity.Deduper) *Ledger {
	l := &Ledger{}
	l.post = dedupactivity.Wrap(d, l.applyPost)
	return l
}

// Post posts a transfer once per event, however often Temporal delivers it.
func (l *Ledger) Post(ctx context.Context, in Transfer) (Posting, error) { return l.post(ctx, in) }

func (l *Ledger) applyPost(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
	var p Posting
	err := tx.QueryRow(ctx, `UPDATE account SET balance = balance + $2 WHERE id = $1 RETURNING balance`,
		in.Account, in.Amount).Scan(&p.Balance)
	return p, err
}

// exampleDeduper is a migrated Deduper on a schema of its own (with an
// account table) on the test server, for the examples that run; done drops
// the schema and closes the pool.
func exampleDeduper() (pool *pgxpool.Pool, d *dedupactivity.Deduper, done func()) {
	s, err := pgtest.Start()
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	schema := "example_" + strings.ReplaceAll(fmt.Sprint(time.Now().UnixNano()), "-", "")
	admin, err := pgxpool.New(ctx, s.URL)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		log.Fatal(err)
	}
	url, _ := pgtest.WithSearchPath(s.URL, schema)
	if pool, err = pgxpool.New(ctx, url); err != nil {
		log.Fatal(err)
	}
	done = func() {
		pool.Close()
		_, _ = admin.Exec(ctx, `DROP SCHEMA `+schema+` CASCADE`)
		admin.Close()
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE account (id text PRIMARY KEY, balance bigint NOT NULL DEFAULT 0); INSERT INTO account VALUES ('a', 0)`); err != nil {
		log.Fatal(err)
	}
	if d, err = dedupactivity.New(pool, dedupactivity.Options{}); err != nil {
		log.Fatal(err)
	}
	if err := d.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	return pool, d, done
}

// The struct form: a Temporal activities struct whose method keeps its
// signature and calls the wrapped effect. Here the same event is delivered
// twice through the test environment; the effect applies once.
func ExampleWrap() {
	_, d, done := exampleDeduper()
	defer done()
	ledger := NewLedger(d)
	for range 2 { // each new environment delivers the same event again
		var suite testsuite.WorkflowTestSuite
		env := suite.NewTestActivityEnvironment()
		env.RegisterActivity(ledger) // as a worker would: w.RegisterActivity(ledger)
		val, err := env.ExecuteActivity(ledger.Post, Transfer{Account: "a", Amount: 5})
		if err != nil {
			log.Fatal(err)
		}
		var p Posting
		if err := val.Get(&p); err != nil {
			log.Fatal(err)
		}
		fmt.Println("balance", p.Balance)
	}
	// Output:
	// balance 5
	// balance 5
}

// Do deduplicates work outside Temporal, with an identity you build.
func ExampleDo() {
	_, d, done := exampleDeduper()
	defer done()
	ctx := context.Background()
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "kafka", ActivityType: "Post", Key: "offset-42"}
	for range 2 {
		p, outcome, err := dedupactivity.Do(ctx, d, id, Transfer{Account: "a", Amount: 7}, NewLedger(d).applyPost)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(outcome, p.Balance)
	}
	// Output:
	// claimed 7
	// duplicate 7
}

// ClaimTx claims inside a transaction the caller owns.
func ExampleClaimTx() {
	pool, d, done := exampleDeduper()
	defer done()
	ctx := context.Background()
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "order-1"}
	for range 2 {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			c, err := dedupactivity.ClaimTx[int64](ctx, d, tx, id, "order-1")
			if err != nil {
				return err // c is nil
			}
			if c.Outcome() != dedupactivity.OutcomeClaimed {
				fmt.Println(c.Outcome(), c.Stored()) // applied before: write nothing
				return nil
			}
			var balance int64
			if err := tx.QueryRow(ctx, `UPDATE account SET balance = balance + 3 WHERE id = 'a' RETURNING balance`).Scan(&balance); err != nil {
				return err
			}
			fmt.Println(c.Outcome(), balance)
			return c.Complete(ctx, balance) // before the commit
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	// Output:
	// claimed 3
	// duplicate 3
}

// Prune deletes expired markers in short batches; RegisterPruner and
// EnsurePruneSchedule run it from a Temporal Schedule.
func ExampleDeduper_Prune() {
	_, d, done := exampleDeduper()
	defer done()
	ctx := context.Background()
	deleted, err := d.Prune(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("pruned", deleted)
	// Output: pruned 0
}
