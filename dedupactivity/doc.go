// Package dedupactivity makes duplicate delivery harmless for Temporal
// activities whose effect is a write to PostgreSQL.
//
// Temporal runs activities at least once: a worker can commit its database
// write and die before it reports completion, and a timed-out attempt can
// still be running while its retry starts elsewhere. A wrapped activity
// claims the event's identity and applies its effect in one PostgreSQL
// transaction, so the effect commits exactly once per identity, and every
// later delivery returns the first attempt's stored result.
//
// # The guarantee
//
// For each event identity, the effect's writes commit at most once, together
// with a marker row; a delivery that finds the marker applies nothing and
// returns the stored result. If anything fails before the commit (the effect
// errors or panics, the context is cancelled, the connection dies), nothing
// commits, the marker included, and the retry applies the effect.
//
// The effect must do all its database writes through the pgx.Tx it is given.
// Nothing outside that transaction is covered: an email, a payment or an
// HTTP call made from the effect can happen more than once. For those, write
// an outbox row through tx and deliver it from a separate process with a key
// the destination deduplicates on (an idempotency key).
//
// # Identity
//
// By default the identity is the workflow run's namespace, workflow ID, run
// ID and activity ID, with a kind that separates local activities (which
// count their IDs separately) and standalone activities (no workflow; their
// activity run ID is used). Retries of one scheduled activity share the
// identity; continue-as-new, workflow retry, cron and reset start a new run
// whose activities are new events. A local activity's retry after a backoff
// longer than the workflow task timeout (10s by default) is not one of
// those: the SDK waits it out with a timer and schedules the retry under a
// new local activity ID, a new event, so an attempt that committed its
// effect and then failed is applied again. Give such local activities
// WithBusinessKey, or a RetryPolicy whose MaximumInterval is within the
// workflow task timeout, whose retries keep their ID. (Temporal's test
// environment retries every local activity through a timer.) An
// ActivityOptions.ActivityID that a workflow sets and reuses in one run
// (Temporal allows it once the earlier activity closed) is the earlier
// activity's identity: the second activity is taken for its duplicate and
// applies nothing, so give each activity its own ID. WithBusinessKey uses
// a key of your own instead (an order ID), scoped by namespace and
// activity type, so the effect happens once per key across runs.
//
// Same identity, different input: the default MismatchReject fails the
// attempt with a non-retryable ApplicationError of type
// ErrTypePayloadMismatch; MismatchReturnStored returns the stored result.
//
// # Round trips
//
// A first delivery costs the round trips of the bare effect in a
// transaction, and a duplicate two (three when the statement that rode with
// a look failed). When the delivery is almost surely new
// (the first attempt of a regular or standalone activity's run-scoped
// identity, or Do with such an identity), a look for the event's marker is
// sent with the effect's first statement and the marker goes in with
// COMMIT: one round trip fewer than the bare effect (a call other than
// Exec, Query or QueryRow with positional arguments puts the marker's key
// in first, in a round trip of its own). This needs a connection that
// caches statements (pgx's default, QueryExecModeCacheStatement), where the
// claim prepares its statements, and the effect's first, once (named
// dedupactivity_<hash>); with any other QueryExecMode its statements are
// sent unnamed and the claim goes first. Retries, business keys
// and local activities claim before the effect runs. A duplicate among the
// riding deliveries (after an operator reset an activity) runs the effect's
// first statement in a transaction that is rolled back, and that call
// returns an error; see EffectFunc. Two riding attempts of one event at the
// same time both run the effect; one commits, the other rolls back on the
// marker's key (an ERROR in the server log) and returns the stored result.
//
// # Example
//
//	d, err := dedupactivity.New(pool, dedupactivity.Options{})
//	if err != nil {
//		return err
//	}
//	if err := d.Migrate(ctx); err != nil {
//		return err
//	}
//	dedupactivity.Register(w, d, "Debit",
//		func(ctx context.Context, tx pgx.Tx, in Debit) (Receipt, error) {
//			var r Receipt
//			err := tx.QueryRow(ctx,
//				`UPDATE account SET balance = balance - $2 WHERE id = $1 RETURNING balance`,
//				in.Account, in.Amount).Scan(&r.Balance)
//			return r, err
//		})
//
// # Testing
//
// Every new testsuite.TestActivityEnvironment has the same workflow, run and
// first activity IDs, so each delivers the same event again (one
// environment gives each ExecuteActivity a new activity ID: a new event).
// Tests that share a marker table see each other's events: give each its
// own Options.Schema or Options.Table. Every delivery there is attempt 1,
// whose claim rides with the effect's first statement (see Round trips): a
// redelivery calls the effect, whose first statement returns an error. To
// test a retry (attempt 2 on), which claims first and does not call the
// effect, run the activity in a TestWorkflowEnvironment and fail attempt 1
// after the wrapped function returned. Count effects with SQL.
//
// # Observability
//
// Every attempt gets a span named "Dedup:<activity type>" (a child of the
// Temporal interceptor's RunActivity span when installed) whose OutcomeKey
// attribute says claimed, duplicate, payload_mismatch, effect_error,
// claim_timeout or error, and the counter MetricAttempts and histograms
// MetricClaimDuration and MetricEffectDuration. Span status is Error only for
// failures: a duplicate is a normal outcome. An attempt whose claim
// prepared statements on its connection has a PrepareEvent.
package dedupactivity
