package outbox_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
)

// TestTemporalHelpersRefuseWhatNewDidNotMake: registering or scheduling a
// nil or zero Relay, Reconciler or Outbox fails with a message that names
// it, at the worker's start, instead of a nil dereference inside the
// registration or a Schedule whose runs all fail.
func TestTemporalHelpersRefuseWhatNewDidNotMake(t *testing.T) {
	t.Parallel()
	const (
		relay      = "outbox: RegisterRelay needs a Relay made by NewRelay"
		reconciler = "outbox: RegisterReconciler needs a Reconciler made by NewReconciler"
		pruner     = "outbox: RegisterPruner needs an Outbox made by New"
	)
	for _, c := range []struct {
		name, want string
		register   func()
	}{
		{"nil Relay", relay, func() { outbox.RegisterRelay(nil, nil) }},
		{"zero Relay", relay, func() { outbox.RegisterRelay(nil, &outbox.Relay{}) }},
		{"nil Reconciler", reconciler, func() { outbox.RegisterReconciler(nil, nil) }},
		{"zero Reconciler", reconciler, func() { outbox.RegisterReconciler(nil, &outbox.Reconciler{}) }},
		{"nil Outbox", pruner, func() { outbox.RegisterPruner(nil, nil) }},
		{"zero Outbox", pruner, func() { outbox.RegisterPruner(nil, &outbox.Outbox{}) }},
	} {
		require.PanicsWithValue(t, c.want, c.register, c.name)
	}

	ctx := context.Background()
	for name, ensure := range map[string]func(c client.Client) error{
		"Relay":      func(c client.Client) error { return outbox.EnsureRelaySchedule(ctx, c, nil, "id", "q", time.Hour) },
		"Reconciler": func(c client.Client) error { return outbox.EnsureReconcileSchedule(ctx, c, nil, "id", "q", time.Hour) },
		"Outbox":     func(c client.Client) error { return outbox.EnsurePruneSchedule(ctx, c, nil, "id", "q", time.Hour) },
	} {
		err := ensure(nil)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, name)
		require.ErrorContains(t, err, name+" made by New", name)
	}
}

// TestEnsureScheduleRefusesANilClient: the error says so, where the
// Schedule client's call would dereference it.
func TestEnsureScheduleRefusesANilClient(t *testing.T) {
	t.Parallel()
	b := setup(t)
	err := outbox.EnsurePruneSchedule(context.Background(), nil, b.ob, "id", "q", time.Hour)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "the Temporal client is nil")
}

// TestRegisterRefusesAStepTheSweepNeverBegins: the sweeps' activity
// (StartToClose 30 minutes) begins no claim whose Lease, and no check whose
// HTTPChecker Timeout, would end in its last minute, so a step of 29
// minutes or more had every scheduled run do nothing and return
// OutOfTime, for ever. RegisterRelay and RegisterReconciler refuse a step
// over 28 minutes at the worker's start; one of 28 minutes is taken, and a
// run of the workflow (with the sweeps' own activity options) sends, and
// asks, with it.
func TestRegisterRefusesAStepTheSweepNeverBegins(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dest := newDestination(t, nil)
	const largest = 28 * time.Minute
	for _, lease := range []time.Duration{largest + time.Nanosecond, 29 * time.Minute, time.Hour} {
		r := b.relay(t, dest, outbox.RelayConfig{Lease: lease})
		var suite testsuite.WorkflowTestSuite
		env := suite.NewTestWorkflowEnvironment()
		require.PanicsWithValue(t, fmt.Sprintf("outbox: RegisterRelay needs a Relay whose Lease is at most 28m0s, got %s: the relay activity (StartToClose 30m0s) claims nothing in its last minute and one Lease, so every run would claim nothing", lease),
			func() { outbox.RegisterRelay(env, r) }, "Lease %s", lease)
	}
	checker := func(timeout time.Duration) outbox.HTTPChecker {
		return outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{"receipts": dest.URL + "/idempotency-keys"}), Timeout: timeout}
	}
	for _, timeout := range []time.Duration{largest + time.Nanosecond, 29 * time.Minute} {
		for _, c := range []outbox.Checker{checker(timeout), ptr(checker(timeout))} {
			rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: c})
			require.NoError(t, err)
			var suite testsuite.WorkflowTestSuite
			env := suite.NewTestWorkflowEnvironment()
			require.PanicsWithValue(t, fmt.Sprintf("outbox: RegisterReconciler needs an HTTPChecker whose Timeout is at most 28m0s, got %s: the reconcile activity (StartToClose 30m0s) asks nothing once a check could end within a minute of its deadline, so every run would ask nothing", timeout),
				func() { outbox.RegisterReconciler(env, rc) }, "Timeout %s (%T)", timeout, c)
		}
	}

	// The largest: registered, and a run does its step.
	r := b.relay(t, dest, outbox.RelayConfig{Lease: largest})
	keys := b.placeN(t, 1)
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestWorkflowEnvironment()
	outbox.RegisterRelay(env, r)
	env.ExecuteWorkflow("DedupOutboxRelay", outbox.RelayActivityName(r))
	require.NoError(t, env.GetWorkflowError())
	var res outbox.RelayResult
	require.NoError(t, env.GetWorkflowResult(&res))
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res, "a Lease of 28m: claimed and sent")
	require.Equal(t, 1, dest.count(keys[0]))

	// Sent, its answer lost: the reconciler asks the destination.
	_, err := b.schema.Pool.Exec(context.Background(), `UPDATE dedup_outbox SET state = 'dead', settled_at = now(), unacked_since = now() - interval '1 hour'`)
	require.NoError(t, err)
	var asked atomic.Int64
	status := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"applied":true}`)
	}))
	t.Cleanup(status.Close)
	rc, err := outbox.NewReconciler(b.ob, outbox.ReconcilerConfig{Checker: outbox.HTTPChecker{
		URL: outbox.StatusURL(map[string]string{"receipts": status.URL}), Timeout: largest}})
	require.NoError(t, err)
	env = suite.NewTestWorkflowEnvironment()
	outbox.RegisterReconciler(env, rc)
	env.ExecuteWorkflow("DedupOutboxReconcile", outbox.ReconcileActivityName(rc))
	require.NoError(t, env.GetWorkflowError())
	var rep outbox.ReconcileReport
	require.NoError(t, env.GetWorkflowResult(&rep))
	require.False(t, rep.OutOfTime, "a Timeout of 28m: asked")
	require.Equal(t, 1, rep.Checked)
	require.Equal(t, 1, rep.Applied)
	require.Equal(t, int64(1), asked.Load())
}

func ptr[T any](v T) *T { return &v }
