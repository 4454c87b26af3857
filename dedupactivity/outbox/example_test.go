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

// A person's pass over the dead letters the reconciler left: each is
// settled after asking its destination (docs/outbox.md, Dead letters).
func ExampleOutbox_DeadLetters() {
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
	letters, err := ob.DeadLetters(ctx, 100)
	if err != nil {
		log.Fatal(err)
	}
	for _, l := range letters {
		log.Printf("%s to %s: %d sends, %d re-queues, died %s: %s", l.Key, l.Destination, l.Attempts, l.Requeues, l.DiedAt.Format(time.RFC3339), l.LastError)
	}
	// Then, per key, what the destination answered:
	//	ob.MarkApplied(ctx, key)                // it applied it
	//	ob.MarkRejected(ctx, key, "why")        // it refused it for good
	//	ob.Requeue(ctx, key)                    // it did not; the cause is fixed
}
