package dedupactivity

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// SetAfterClaimHook installs a hook that runs after the claim inserted the
// marker and before the effect, inside the claim transaction.
func SetAfterClaimHook(d *Deduper, hook func(ctx context.Context, tx pgx.Tx) error) {
	d.afterClaim = hook
}

// Fingerprint exposes the input fingerprint for tests.
func Fingerprint(in any) ([]byte, error) { return fingerprint(in) }

// PruneActivityName exposes the name of d's prune activity.
func PruneActivityName(d *Deduper) string { return d.pruneActivityName() }

// ErrDuplicate is what an effect's first statement returns when the claim
// that rode with it found the event applied.
var ErrDuplicate = errDuplicate

// MayRide exposes whether a delivery's claim may ride with its effect's
// first statement.
var MayRide = mayRide

// PruneWithProgress runs Prune with its progress hook, called before each
// past partition is read.
func PruneWithProgress(ctx context.Context, d *Deduper, progress func(deleted int64)) (int64, error) {
	n, _, err := d.prune(ctx, progress, time.Time{})
	return n, err
}

// PruneBy runs Prune as the prune activity does, beginning nothing after
// stopBy.
func PruneBy(ctx context.Context, d *Deduper, stopBy time.Time) (PruneResult, error) {
	n, outOfTime, err := d.prune(ctx, nil, stopBy)
	return PruneResult{Deleted: n, OutOfTime: outOfTime}, err
}

// SetPruneHeartbeat makes d's prune activity heartbeat every every.
func SetPruneHeartbeat(d *Deduper, every time.Duration) { d.pruneBeat = every }

// MigrateLockKey is the advisory lock Migrate applies the migrations under.
const MigrateLockKey = migrateLockKey
