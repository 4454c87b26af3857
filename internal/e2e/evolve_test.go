package e2e

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/temporaltest"
)

// PaymentV1 and PaymentV2 are one activity input before and after a deploy
// that adds fields.
type PaymentV1 struct {
	Order  string
	Amount int64
}

type PaymentV2 struct {
	Amount   int64
	Order    string
	Currency string
	Notes    []string `json:",omitempty"`
}

// PaymentResult is what the payment activity returns.
type PaymentResult struct {
	EntryID int64
}

func evolveWorkflow(ctx workflow.Context, in PaymentV1) (PaymentResult, error) {
	ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{
		StartToCloseTimeout: 10 * time.Second,
		RetryPolicy:         &temporal.RetryPolicy{InitialInterval: 2 * time.Second, MaximumAttempts: 5},
	})
	var r PaymentResult
	err := workflow.ExecuteActivity(ctx, "Pay", in).Get(ctx, &r)
	return r, err
}

// TestInputEvolvesAcrossDeploy: on a real dev server, the first attempt runs
// on a worker with input struct V1, commits, and loses its completion; the
// retry runs on a new worker whose input struct has gained fields. It is a
// duplicate (the stored result comes back, the effect is not applied again),
// for a run-scoped identity and for a business key.
func TestInputEvolvesAcrossDeploy(t *testing.T) {
	t.Parallel()
	for name, keyed := range map[string]bool{"RunScoped": false, "BusinessKey": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			srv := temporaltest.Require(t)
			s := pgtest.NewSchema(t)
			ctx := context.Background()
			_, err := s.Pool.Exec(ctx, `CREATE TABLE payment (id bigserial PRIMARY KEY, order_id text NOT NULL, amount bigint NOT NULL)`)
			require.NoError(t, err)
			d, err := dedupactivity.New(s.Pool, dedupactivity.Options{})
			require.NoError(t, err)
			require.NoError(t, d.Migrate(ctx))
			c, err := srv.Dial()
			require.NoError(t, err)
			defer c.Close()
			taskQueue := "evolve-" + randomHex()
			pay := func(ctx context.Context, tx pgx.Tx, order string, amount int64) (PaymentResult, error) {
				var r PaymentResult
				err := tx.QueryRow(ctx, `INSERT INTO payment (order_id, amount) VALUES ($1, $2) RETURNING id`, order, amount).Scan(&r.EntryID)
				return r, err
			}
			var opts1, opts2 []dedupactivity.WrapOption
			if keyed {
				opts1 = append(opts1, dedupactivity.WithBusinessKey(func(in PaymentV1) (string, error) { return in.Order, nil }))
				opts2 = append(opts2, dedupactivity.WithBusinessKey(func(in PaymentV2) (string, error) { return in.Order, nil }))
			}

			// v1: commits, then loses its completion.
			v1 := dedupactivity.Wrap(d, func(ctx context.Context, tx pgx.Tx, in PaymentV1) (PaymentResult, error) {
				return pay(ctx, tx, in.Order, in.Amount)
			}, opts1...)
			ranV1 := make(chan struct{})
			w1 := worker.New(c, taskQueue, worker.Options{})
			w1.RegisterWorkflow(evolveWorkflow)
			w1.RegisterActivityWithOptions(func(ctx context.Context, in PaymentV1) (PaymentResult, error) {
				if _, err := v1(ctx, in); err != nil {
					return PaymentResult{}, err
				}
				close(ranV1)
				return PaymentResult{}, errors.New("injected: completion lost after commit")
			}, activity.RegisterOptions{Name: "Pay"})
			require.NoError(t, w1.Start())
			run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{TaskQueue: taskQueue, WorkflowExecutionTimeout: time.Minute}, evolveWorkflow, PaymentV1{Order: "o-" + name, Amount: 42})
			require.NoError(t, err)
			<-ranV1
			w1.Stop() // the deploy: v1 goes away before the retry (2s later)

			w2 := worker.New(c, taskQueue, worker.Options{})
			w2.RegisterWorkflow(evolveWorkflow)
			w2.RegisterActivityWithOptions(dedupactivity.Wrap(d, func(ctx context.Context, tx pgx.Tx, in PaymentV2) (PaymentResult, error) {
				return pay(ctx, tx, in.Order, in.Amount)
			}, opts2...), activity.RegisterOptions{Name: "Pay"})
			require.NoError(t, w2.Start())
			defer w2.Stop()

			var got PaymentResult
			require.NoError(t, run.Get(ctx, &got), "the retry on v2 is a duplicate, not a mismatch")
			var rows int64
			var entry int64
			require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*), max(id) FROM payment`).Scan(&rows, &entry))
			require.Equal(t, int64(1), rows, "applied once")
			require.Equal(t, entry, got.EntryID, "the stored result of the v1 attempt")
		})
	}
}
