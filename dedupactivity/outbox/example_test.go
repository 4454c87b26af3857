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
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/app")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{})
	if err != nil {
		log.Fatal(err)
	}
	ob, err := outbox.New(pool, outbox.Options{})
	if err != nil {
		log.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil { // idempotent, advisory-locked
		log.Fatal(err)
	}
	c, err := client.Dial(client.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	w := worker.New(c, "orders", worker.Options{})

	// The receipt is enqueued in the effect's transaction: it commits once,
	// with the order, and its key is the same on every attempt.
	dedupactivity.Register(w, d, "PlaceOrder", func(ctx context.Context, tx pgx.Tx, in Order) (string, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id) VALUES ($1)`, in.ID); err != nil {
			return "", err
		}
		return ob.Enqueue(ctx, tx, outbox.Message{Destination: "receipts", Name: "receipt", Payload: in})
	})
	if err := w.Run(worker.InterruptCh()); err != nil {
		log.Fatal(err)
	}
}

func ExampleRelay_Run() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/app")
	if err != nil {
		log.Fatal(err)
	}
	ob, err := outbox.New(pool, outbox.Options{})
	if err != nil {
		log.Fatal(err)
	}
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
	go func() {
		defer close(done)
		if err := relay.Run(ctx); err != nil {
			log.Print(err)
		}
	}()

	// At shutdown, stop the relay and wait for it before the pool closes:
	// it gives back the messages it leased and has not sent.
	stop()
	<-done
	pool.Close()
}

func ExampleEnsureReconcileSchedule() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/app")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	ob, err := outbox.New(pool, outbox.Options{})
	if err != nil {
		log.Fatal(err)
	}
	rc, err := outbox.NewReconciler(ob, outbox.ReconcilerConfig{
		Checker: outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{"receipts": "http://127.0.0.1:8081/idempotency-keys"})},
	})
	if err != nil {
		log.Fatal(err)
	}
	c, err := client.Dial(client.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	w := worker.New(c, "orders", worker.Options{})
	outbox.RegisterReconciler(w, rc)
	if err := outbox.EnsureReconcileSchedule(ctx, c, rc, "outbox-reconcile", "orders", time.Minute); err != nil {
		log.Fatal(err)
	}
}
