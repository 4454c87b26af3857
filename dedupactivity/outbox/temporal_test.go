package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"

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
