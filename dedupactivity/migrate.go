package dedupactivity

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/pgschema"
	"github.com/dedupactivity/dedupactivity/migrations"
)

// migration is one versioned SQL migration of a layout.
type migration struct {
	version int
	name    string
	up      string
}

var migrationFileRE = regexp.MustCompile(`^(\d{3})_([a-z0-9_]+)\.up\.sql$`)

// readMigrations returns the up migrations of a layout in version order,
// with the table name still the files' own (migrations.TableToken).
func readMigrations(partitioned bool) ([]migration, error) {
	fsys, dir := fs.FS(migrations.FS), "."
	if partitioned {
		fsys, dir = migrations.PartitionedFS, "partitioned"
	}
	entries, err := fs.ReadDir(fsys, dir)
	if err != nil {
		return nil, fmt.Errorf("dedupactivity: read migrations: %w", err)
	}
	var out []migration
	for _, e := range entries {
		m := migrationFileRE.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		v, _ := strconv.Atoi(m[1])
		body, err := fs.ReadFile(fsys, path.Join(dir, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("dedupactivity: read migration %s: %w", e.Name(), err)
		}
		out = append(out, migration{version: v, name: m[2], up: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].version < out[j].version })
	return out, nil
}

// markerColumns are the columns the claim uses; a table that has them all is
// taken as migrated, whoever created it.
var markerColumns = []string{"id_hash", "attempt", "claimed_at", "expires_at", "activity_type", "fingerprint", "result"}

// migrateLockKey is the advisory lock every Migrate in a database takes, so
// that concurrent calls creating tables in one new schema do not race on the
// catalog.
const migrateLockKey int64 = 0x6465_6475_705f_6d69 // "dedup_mi"

// migrateLockTimeout bounds Migrate's wait for a table lock (see Migrate).
const migrateLockTimeout = 500 * time.Millisecond

// Migrate creates the marker table (and its schema, when Options.Schema is
// set) if it is not there yet. It is safe to run from many workers at once
// and after a migration tool applied the files of the migrations package:
//
//   - When the table has every column this version uses (and its functions
//     are there), Migrate only reads the catalog (one round trip, no lock,
//     no CREATE privilege needed), so a least-privilege worker can call it
//     at every start. In the partitioned layout it then creates the
//     missing partitions of the current and the next PartitionsAhead
//     intervals (as Prune does), if its role may.
//   - Otherwise it applies the migrations in one transaction under an
//     advisory lock and records them in a table named <Table>_migration.
//     The files are idempotent, so a table dropped by hand or by the down
//     files is simply made again. A lock on an existing table is waited
//     for at most migrateLockTimeout (500ms), so that a long transaction
//     on it does not hold every claim behind the migration's lock request;
//     the error then has SQLSTATE 55P03 (lock_not_available): call Migrate
//     again.
//   - A version recorded by a newer release of this package fails with
//     ErrSchemaTooNew.
//   - A table of the other layout (partitioned, or not, against
//     Options.PartitionInterval) fails with ErrInvalidOptions, and so does
//     a table of that name that lacks a marker table's columns (made by
//     something else), naming them.
func (d *Deduper) Migrate(ctx context.Context) error {
	migs, err := readMigrations(d.opts.PartitionInterval > 0)
	if err != nil {
		return err
	}
	latest := migs[len(migs)-1].version
	versionTable := d.qualify(d.opts.Table + "_migration")

	var missing []string // of markerColumns
	var hasFunc, hasVersions bool
	var partitioned *bool // nil: no table yet
	var inCurrentSchema *bool
	if err := d.pool.QueryRow(ctx, catalogSQL, d.store.table, markerColumns, versionTable, d.functions()).Scan(&missing, &hasVersions, &hasFunc, &partitioned, &inCurrentSchema); err != nil {
		return fmt.Errorf("dedupactivity: migrate: read catalog: %w", err)
	}
	// A table without all the marker's columns: only one migration makes
	// the table, so it was made by something else (or by a newer release,
	// which the version check below reports first).
	foreign := partitioned != nil && len(missing) > 0
	if foreign && d.opts.Schema == "" && !*inCurrentSchema {
		// The unqualified name found it further down search_path: the
		// files make the marker table in current_schema(), which the
		// claims' statements then find first.
		partitioned, foreign = nil, false
	}
	if partitioned != nil && *partitioned != (d.opts.PartitionInterval > 0) {
		return d.layoutError(*partitioned)
	}
	var recorded *int
	if hasVersions { // and readable: a role without SELECT on it skips this check
		if err := d.pool.QueryRow(ctx, maxVersionSQL(versionTable)).Scan(&recorded); err != nil {
			return fmt.Errorf("dedupactivity: migrate: read versions: %w", err)
		}
	}
	if recorded != nil && *recorded > latest {
		return fmt.Errorf("%w: %s records version %d, this package knows up to %d (a newer release made it, or an unreleased build from before the migrations were folded into one: drop and re-create such a table)", ErrSchemaTooNew, versionTable, *recorded, latest)
	}
	if foreign {
		// The files (CREATE TABLE IF NOT EXISTS) would leave it as it is,
		// and every claim would fail.
		return fmt.Errorf("%w: the table %s exists without the column(s) %s of a marker table: it was not made by dedupactivity (or by a build from before its migrations were folded into one); give Options another Table (or Schema), or drop it", ErrInvalidOptions, d.store.table, strings.Join(missing, ", "))
	}
	if len(missing) > 0 || !hasFunc {
		if err := d.applyMigrations(ctx, migs, versionTable); err != nil {
			return err
		}
	}
	if d.opts.PartitionInterval > 0 {
		// A role that may claim but does not own the table (see Security in
		// docs/design.md) leaves the partitions to the pruner, which runs as
		// the owner; claims go to the default partition meanwhile. So does a
		// worker starting while claims hold the lock a partition needs:
		// Prune fails on it, Migrate at start does not.
		if _, err := d.ensurePartitions(ctx); err != nil && sqlState(err) != stateInsufficientPrivilege && sqlState(err) != stateLockNotAvailable {
			return err
		}
	}
	return nil
}

// layoutError is Migrate's refusal of a table whose layout (partitioned or
// not) is not the one of these Options.
func (d *Deduper) layoutError(partitioned bool) error {
	layout := map[bool]string{true: "the partitioned layout (PartitionInterval set)", false: "the default layout (PartitionInterval 0)"}
	return fmt.Errorf("%w: %s is a table of %s, and these Options are for %s: give Options the table's layout, or another Table", ErrInvalidOptions, d.store.table, layout[partitioned], layout[!partitioned])
}

// functions are the marker table's functions, as regprocedure text.
func (d *Deduper) functions() []string {
	return []string{d.qualify(d.opts.Table+"_ended") + "()", d.qualify(d.opts.Table+"_moved") + "()"}
}

// createSchema creates Options.Schema (if set) unless it exists, in a
// statement of its own before the migration's transaction (see
// pgschema.Ensure).
func (d *Deduper) createSchema(ctx context.Context) error {
	if d.opts.Schema == "" {
		return nil
	}
	return pgschema.Ensure(ctx, d.pool, d.opts.Schema)
}

// applyMigrations runs the migrations in one transaction under
// migrateLockKey, after creating the schema on its own (see createSchema).
func (d *Deduper) applyMigrations(ctx context.Context, migs []migration, versionTable string) error {
	if err := d.createSchema(ctx); err != nil {
		return fmt.Errorf("dedupactivity: migrate: create schema: %w", err)
	}
	return pgx.BeginFunc(ctx, d.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, advisoryXactLockSQL, migrateLockKey); err != nil {
			return fmt.Errorf("dedupactivity: migrate: advisory lock: %w", err)
		}
		// After the advisory lock, which waits for other Migrates as long
		// as they take.
		if _, err := tx.Exec(ctx, setLocalLockTimeoutSQL, string(appendLockTimeout(nil, migrateLockTimeout))); err != nil {
			return fmt.Errorf("dedupactivity: migrate: lock_timeout: %w", err)
		}
		if d.opts.Schema != "" {
			schema := pgx.Identifier{d.opts.Schema}.Sanitize()
			// The files name tables unqualified.
			if _, err := tx.Exec(ctx, setLocalSearchPathSQL, schema); err != nil {
				return fmt.Errorf("dedupactivity: migrate: search_path: %w", err)
			}
		}
		// The layout again, under the lock: the other layout's table may
		// have been made since the catalog was read (another worker's
		// Migrate with the other Options, or a migration tool), and the
		// default layout's files run on a partitioned table without an
		// error (adding an expiry index to every partition).
		var partitioned *bool
		if err := tx.QueryRow(ctx, layoutSQL, d.opts.Table).Scan(&partitioned); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("dedupactivity: migrate: read catalog: %w", err)
		}
		if partitioned != nil && *partitioned != (d.opts.PartitionInterval > 0) {
			return d.layoutError(*partitioned)
		}
		if _, err := tx.Exec(ctx, createVersionTableSQL(versionTable)); err != nil {
			return fmt.Errorf("dedupactivity: migrate: version table: %w", err)
		}
		for _, m := range migs {
			sql := strings.ReplaceAll(m.up, migrations.TableToken, d.opts.Table)
			if _, err := tx.Exec(ctx, sql); err != nil {
				if sqlState(err) == stateLockNotAvailable {
					return fmt.Errorf("dedupactivity: migrate: apply %03d_%s: a transaction held the table for longer than %s (retry): %w", m.version, m.name, migrateLockTimeout, err)
				}
				return fmt.Errorf("dedupactivity: migrate: apply %03d_%s: %w", m.version, m.name, err)
			}
			if _, err := tx.Exec(ctx, recordVersionSQL(versionTable), m.version, m.name); err != nil {
				return fmt.Errorf("dedupactivity: migrate: record %03d_%s: %w", m.version, m.name, err)
			}
		}
		return nil
	})
}
