package outbox

import (
	"context"
	"time"
)

// SetAfterSendHook installs a hook that runs after a successful send and
// before its acknowledgement; an error stops the pass there, as if the relay
// process had died.
func SetAfterSendHook(r *Relay, hook func(Delivery) error) { r.afterSend = hook }

// SetBeforeSendHook installs a hook that runs before a send begins; an
// error stops the pass there, the message left leased, as if the relay
// process had died.
func SetBeforeSendHook(r *Relay, hook func(Delivery) error) { r.beforeBegin = hook }

// RelayWorkflow, RelayActivityName and ReconcileActivityName expose the
// names RegisterRelay and RegisterReconciler register, for tests.
var RelayWorkflow = sweep[RelayResult]

func RelayActivityName(r *Relay) string { return r.relayActivityName() }

func ReconcileActivityName(rc *Reconciler) string { return rc.reconcileActivityName() }

// PruneActivityName exposes the name of ob's prune activity.
func PruneActivityName(ob *Outbox) string { return ob.pruneActivityName() }

// BacklogQuery is the count the outbox's gauges read at each collection.
func BacklogQuery(ob *Outbox) string { return ob.backlogQuery() }

// ReconcileActivity is the activity RegisterReconciler registers.
func ReconcileActivity(rc *Reconciler) func(context.Context) (ReconcileReport, error) {
	return rc.reconcileActivity
}

// PruneUntil is the prune activity's Prune, beginning no batch after stopBy.
func PruneUntil(ctx context.Context, ob *Outbox, stopBy time.Time) (int64, bool, error) {
	return ob.prune(ctx, nil, stopBy)
}

// OutboxColumns are the columns Migrate requires of an outbox table there.
var OutboxColumns = outboxColumns

// SetRelayHeartbeat makes r's activity heartbeat every every besides after
// each message.
func SetRelayHeartbeat(r *Relay, every time.Duration) { r.beatEvery = every }

// SetReconcileHeartbeat makes rc's activity heartbeat every every besides
// before each check.
func SetReconcileHeartbeat(rc *Reconciler, every time.Duration) { rc.beatEvery = every }
