package dedupactivity

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Deduper stores event markers in a PostgreSQL table and applies effects at
// most once per event identity. It is safe for concurrent use; build one per
// worker process and share it between wrapped activities.
type Deduper struct {
	pool  *pgxpool.Pool
	opts  Options
	table string // schema-qualified, quoted table name
	// claimFunc is the qualified name of the claim function.
	claimFunc string
	q         queries
	tel       *telemetry

	// afterClaim, when set (tests only), runs after the marker insert and
	// before the effect, inside the claim transaction.
	afterClaim func(ctx context.Context, tx pgx.Tx) error
}

// New returns a Deduper storing its markers through pool. opts is checked;
// an error names the field at fault and wraps ErrInvalidOptions.
func New(pool *pgxpool.Pool, opts Options) (*Deduper, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidOptions)
	}
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	tel, err := newTelemetry(opts.TracerProvider, opts.MeterProvider)
	if err != nil {
		return nil, fmt.Errorf("dedupactivity: telemetry: %w", err)
	}
	d := &Deduper{pool: pool, opts: opts, tel: tel}
	d.table = d.qualify(opts.Table)
	d.claimFunc = d.qualify(opts.Table + "_claim")
	d.q = newQueries(d.table, opts.PartitionInterval > 0, d.qualify(opts.Table+"_default"))
	return d, nil
}

// Options returns the Deduper's options with defaults filled in.
func (d *Deduper) Options() Options { return d.opts }

// queries holds the SQL with the table name filled in once.
type queries struct {
	selectStoredLiteral, storeResult, prune string
}

// newQueries builds the queries for table. In the partitioned layout the
// result is stored by (id_hash, scheduled_at), and row-by-row pruning covers
// only the default partition (the others are dropped whole).
func newQueries(table string, partitioned bool, defaultPartition string) queries {
	key, pruned := `id_hash = $1`, table
	if partitioned {
		key, pruned = `id_hash = $1 AND scheduled_at = $3`, defaultPartition
	}
	return queries{
		// Completed with a literal; for the simple protocol.
		selectStoredLiteral: `SELECT fingerprint, fingerprint_alg, result, attempt FROM ` + table + ` WHERE id_hash = `,
		// Fails (division by zero) unless it updated the marker.
		storeResult: `WITH u AS (UPDATE ` + table + ` SET result = $2 WHERE ` + key + ` RETURNING 1) SELECT 1 / count(*) FROM u`,
		prune: `DELETE FROM ` + pruned + ` WHERE id_hash = ANY (ARRAY(
	SELECT id_hash FROM ` + pruned + ` WHERE expires_at < now()
	ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))`,
	}
}

// translate turns PostgreSQL errors this package knows into its own.
func translate(err error) error {
	switch sqlState(err) {
	case "42P01", "42883": // undefined_table, undefined_function (the claim)
		return fmt.Errorf("%w: %w", ErrNotMigrated, err)
	case "55P03": // lock_not_available: lock_timeout expired
		return fmt.Errorf("%w: %w", ErrClaimTimeout, err)
	}
	return err
}
