package outbox_test

import (
	"context"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/worker"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
)

func ExampleOutbox_Enqueue() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, "postgres://localhost:5432/app")
	d, _ := dedupactivity.New(pool, dedupactivity.Options{})
	ob, _ := outbox.New(pool, outbox.Options{})
	if err := ob.Migrate(ctx); err != nil { // idempotent, advisory-locked
		log.Fatal(err)
	}
	c, _ := client.Dial(client.Options{})
	w := worker.New(c, "orders", worker.Options{})

	// The receipt is enqueued in the effect's transaction: it commits once,
	// with the order, and its key is the same on every attempt.
	dedupactivity.Register(w, d, "PlaceOrder", func(ctx context.Context, tx pgx.Tx, in Order) (string, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id) VALUES ($1)`, in.ID); err != nil {
			return "", err
		}
		return ob.Enqueue(ctx, tx, outbox.Message{Destination: "receipts", Name: "receipt", Payload: in})
	})
}

func ExampleRelay_Run() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, "postgres://localhost:5432/app")
	ob, _ := outbox.New(pool, outbox.Options{})
	sender, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{
		Endpoints: map[string]string{"receipts": "http://127.0.0.1:8081/receipts"},
	})
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.NewRelay(ob, outbox.RelayConfig{Sender: sender})
	if err != nil {
		log.Fatal(err)
	}
	// In every worker process: relays share the work.
	ctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(ctx) }()

	// At shutdown, stop the relay and wait for it before the pool closes:
	// it gives back the messages it leased and has not sent.
	stop()
	<-done
	pool.Close()
}

func ExampleEnsureReconcileSchedule() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, "postgres://localhost:5432/app")
	ob, _ := outbox.New(pool, outbox.Options{})
	rc, _ := outbox.NewReconciler(ob, outbox.ReconcilerConfig{
		Checker: outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{"receipts": "http://127.0.0.1:8081/idempotency-keys"})},
	})
	c, _ := client.Dial(client.Options{})
	w := worker.New(c, "orders", worker.Options{})
	outbox.RegisterReconciler(w, rc)
	if err := outbox.EnsureReconcileSchedule(ctx, c, rc, "outbox-reconcile", "orders", time.Minute); err != nil {
		log.Fatal(err)
	}
}
