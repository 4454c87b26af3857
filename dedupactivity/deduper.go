package dedupactivity

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Deduper stores event markers in a PostgreSQL table and applies effects at
// most once per event identity. It is safe for concurrent use; build one per
// worker process and share it between wrapped activities.
type Deduper struct {
	pool  *pgxpool.Pool
	opts  Options
	store *store
	tel   *telemetry

	// afterClaim, when set (tests only), runs after the claim inserted the
	// marker and before the effect, inside the claim transaction.
	afterClaim func(ctx context.Context, tx pgx.Tx) error
	// pruneBeat, when set (tests only), is how often the prune activity
	// heartbeats instead of pruneHeartbeatEvery.
	pruneBeat time.Duration
}

// made says whether d was made by New: not nil, and not a zero Deduper.
func (d *Deduper) made() bool { return d != nil && d.pool != nil }

// New returns a Deduper storing its markers through pool. opts is checked;
// an error names the field at fault and wraps ErrInvalidOptions. New
// registers the MetricOldestMarkerAge and MetricOverdueMarkerAge gauges
// with Options.MeterProvider for the life of the process, read by one query
// per collection: make one
// Deduper per table and share it.
func New(pool *pgxpool.Pool, opts Options) (*Deduper, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidOptions)
	}
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	table := opts.Table // the metrics' dedup.table: schema-qualified when Schema is set
	if opts.Schema != "" {
		table = opts.Schema + "." + opts.Table
	}
	tel, err := newTelemetry(opts.TracerProvider, opts.MeterProvider, opts.TemporalMetrics, table, opts.MismatchPolicy)
	if err != nil {
		return nil, fmt.Errorf("dedupactivity: telemetry: %w", err)
	}
	d := &Deduper{pool: pool, opts: opts, tel: tel}
	d.store = newStore(d.qualify(opts.Table), d.qualify(opts.Table+"_ended"), d.qualify(opts.Table+"_moved"), opts.PartitionInterval > 0, d.qualify(opts.Table+"_default"), opts.Retention)
	if err := tel.observeMarkers(d); err != nil {
		return nil, fmt.Errorf("dedupactivity: telemetry: %w", err)
	}
	return d, nil
}

func (d *Deduper) qualify(name string) string {
	if d.opts.Schema != "" {
		return pgx.Identifier{d.opts.Schema, name}.Sanitize()
	}
	return pgx.Identifier{name}.Sanitize()
}

// Applied says whether the event id was applied: its marker is committed
// (until Prune removes it after its retention). A destination answers a
// reconciler's "did you apply key K?" with it.
func (d *Deduper) Applied(ctx context.Context, id Identity) (bool, error) {
	enc := id.Encode()
	if err := id.validate(enc); err != nil {
		return false, err
	}
	h := sha256Sum(enc)
	var ok bool
	if err := d.pool.QueryRow(ctx, d.store.exists, h[:]).Scan(&ok); err != nil {
		return false, fmt.Errorf("dedupactivity: applied: %w", interpretError(err, false))
	}
	return ok, nil
}

// Result reads the result stored for the event id into out (a pointer, as
// the data converter's FromPayload takes it) and says whether id was
// applied, as Applied does. When it was not, or no result is stored
// (DiscardResults), out is left as it is. When the event was applied but no
// result was recorded (its effect ended the claim transaction, or ClaimTx
// was committed without Complete), Result returns true and an error
// wrapping ErrTxEnded, as deliveries of it do. A destination reads with it
// what it answered, to tell a reconciler that it refused a message rather
// than applied it.
//
// The result is decoded with the serialization context that id alone
// gives (its namespace, workflow ID and, for a business key, activity
// type), which is the one Do uses outside an activity, whatever ctx is. A
// data converter that keys on more of the context (the task queue, the
// workflow or activity type of a wrapped activity) cannot decode a
// wrapped activity's result this way, and Result fails with ErrEncoding.
func (d *Deduper) Result(ctx context.Context, id Identity, out any) (bool, error) {
	enc := id.Encode()
	if err := id.validate(enc); err != nil {
		return false, err
	}
	h := sha256Sum(enc)
	var hexResult *string
	if err := d.pool.QueryRow(ctx, d.store.result, h[:]).Scan(&hexResult); errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	} else if err != nil {
		return false, fmt.Errorf("dedupactivity: result: %w", interpretError(err, false))
	}
	if hexResult == nil {
		return true, fmt.Errorf("%w: the event was applied, but its effect ended the claim transaction (or its caller committed without Claim.Complete), so no result was recorded", ErrTxEnded)
	}
	b, err := hex.DecodeString(*hexResult)
	if err != nil {
		return true, fmt.Errorf("%w: stored result: %w", ErrEncoding, err)
	}
	if len(b) == 0 {
		return true, nil // results are discarded
	}
	return true, decodeResult(d.converter(ctx, identityInfo(id)), b, out)
}
