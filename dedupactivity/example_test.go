package dedupactivity_test

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/worker"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
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
	// Safe to run from every worker at start: an advisory lock serialises it.
	if err := d.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
}

func ExampleRegister() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, "postgres://localhost:5432/app")
	d, _ := dedupactivity.New(pool, dedupactivity.Options{})
	c, _ := client.Dial(client.Options{})
	w := worker.New(c, "ledger", worker.Options{})

	// The effect runs once per event, in the claim's transaction.
	dedupactivity.Register(w, d, "Post", func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		var p Posting
		err := tx.QueryRow(ctx,
			`UPDATE account SET balance = balance + $2 WHERE id = $1 RETURNING balance`,
			in.Account, in.Amount).Scan(&p.Balance)
		return p, err
	})
}

func ExampleWithBusinessKey() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, "postgres://localhost:5432/app")
	d, _ := dedupactivity.New(pool, dedupactivity.Options{})

	// Once per order ID, whichever workflow run delivers it.
	_ = dedupactivity.Wrap(d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (account, amount) VALUES ($1, $2)`, in.Account, in.Amount)
		return Posting{}, err
	}, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return "order-" + in.Account, nil }))
}
