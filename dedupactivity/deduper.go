package dedupactivity

import (
	"context"
	"fmt"
	"hash/fnv"

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
	// lockFunc is the qualified name of the claim's lock function.
	lockFunc string
	// lockSalt mixes the table into event lock keys.
	lockSalt uint64
	q        queries
	tel      *telemetry

	// afterClaim, when set (tests only), runs after the claim (the event's
	// lock and the look for its marker) and before the effect, inside the
	// claim transaction.
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
	tel, err := newTelemetry(opts.TracerProvider, opts.MeterProvider, opts.TemporalMetrics, opts.Table)
	if err != nil {
		return nil, fmt.Errorf("dedupactivity: telemetry: %w", err)
	}
	d := &Deduper{pool: pool, opts: opts, tel: tel}
	d.table = d.qualify(opts.Table)
	if err := tel.observeOldest(d); err != nil {
		return nil, fmt.Errorf("dedupactivity: telemetry: %w", err)
	}
	d.lockFunc = d.qualify(opts.Table + "_lock")
	d.lockSalt = d.tableKey("event")
	d.q = newQueries(d.table, opts.PartitionInterval > 0, d.qualify(opts.Table+"_default"))
	return d, nil
}

// tableKey is a 64-bit key for purpose on this Deduper's table (advisory
// lock keys are derived from it).
func (d *Deduper) tableKey(purpose string) uint64 {
	h := fnv.New64a()
	h.Write([]byte("dedupactivity." + purpose + ":" + d.table))
	return h.Sum64()
}

// Options returns the Deduper's options with defaults filled in.
func (d *Deduper) Options() Options { return d.opts }

// queries holds the SQL with the table name filled in once.
type queries struct {
	selectStoredLiteral, insertMarker, prune string
}

// newQueries builds the queries for table. In the partitioned layout the
// marker also carries its partition key, and row-by-row pruning covers only
// the default partition (the others are dropped whole).
func newQueries(table string, partitioned bool, defaultPartition string) queries {
	keyCol, keyVal, pruned := ``, ``, table
	if partitioned {
		keyCol, keyVal, pruned = `, scheduled_at`, `, $10`, defaultPartition
	}
	return queries{
		// Completed with a literal; for the simple protocol.
		selectStoredLiteral: `SELECT fingerprint, fingerprint_alg, result, attempt FROM ` + table + ` WHERE id_hash = `,
		// Fails (division by zero) unless it inserted the marker.
		insertMarker: `WITH i AS (INSERT INTO ` + table + ` (id_hash, identity, activity_type, fingerprint, fingerprint_alg, attempt, result, expires_at` + keyCol + `)
	VALUES ($1, $2, $3, $4, $5, $6, $7, GREATEST(now() + make_interval(secs => $8), $9::timestamptz)` + keyVal + `)
	ON CONFLICT DO NOTHING RETURNING 1)
SELECT 1 / count(*) FROM i`,
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
