package dedupactivity

import (
	"context"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/dedupactivity/dedupactivity/migrations"
)

// Migration is one versioned SQL migration from the migrations directory.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
}

var migrationFileRE = regexp.MustCompile(`^(\d{3})_([a-z0-9_]+)\.(up|down)\.sql$`)

// Migrations returns the embedded migrations of the default layout in
// version order, with the table name still the file's own
// (migrations.TableToken).
func Migrations() ([]Migration, error) { return readMigrations(migrations.FS, ".") }

// PartitionedMigrations returns the migrations of the partitioned layout
// (Options.PartitionInterval > 0).
func PartitionedMigrations() ([]Migration, error) {
	return readMigrations(migrations.PartitionedFS, "partitioned")
}

func readMigrations(fsys fs.FS, dir string) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, dir)
	if err != nil {
		return nil, fmt.Errorf("dedupactivity: read migrations: %w", err)
	}
	byVersion := map[int]*Migration{}
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
		mig := byVersion[v]
		if mig == nil {
			mig = &Migration{Version: v, Name: m[2]}
			byVersion[v] = mig
		}
		if m[3] == "up" {
			mig.Up = string(body)
		} else {
			mig.Down = string(body)
		}
	}
	out := make([]Migration, 0, len(byVersion))
	for _, m := range byVersion {
		if m.Up == "" || m.Down == "" {
			return nil, fmt.Errorf("dedupactivity: migration %03d_%s lacks its up or down file", m.Version, m.Name)
		}
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Migrate creates or upgrades the marker table (and its schema, when
// Options.Schema is set). It is idempotent and safe to run from many workers
// at once: all of it runs in one transaction holding an advisory lock keyed
// by the table's name, and applied versions are recorded in a table named
// <Table>_migration beside the marker table.
func (d *Deduper) Migrate(ctx context.Context) error {
	migs, err := Migrations()
	if d.opts.PartitionInterval > 0 {
		migs, err = PartitionedMigrations()
	}
	if err != nil {
		return err
	}
	tx, err := d.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("dedupactivity: migrate: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit

	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, d.lockKey()); err != nil {
		return fmt.Errorf("dedupactivity: migrate: advisory lock: %w", err)
	}
	if d.opts.Schema != "" {
		schema := pgx.Identifier{d.opts.Schema}.Sanitize()
		if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+schema); err != nil {
			return fmt.Errorf("dedupactivity: migrate: create schema: %w", err)
		}
		// The files name tables unqualified.
		if _, err := tx.Exec(ctx, `SELECT set_config('search_path', $1, true)`, schema); err != nil {
			return fmt.Errorf("dedupactivity: migrate: search_path: %w", err)
		}
	}
	versionTable := pgx.Identifier{d.opts.Table + "_migration"}.Sanitize()
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+versionTable+` (
	version    integer     PRIMARY KEY,
	name       text        NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return fmt.Errorf("dedupactivity: migrate: version table: %w", err)
	}
	applied := map[int]bool{}
	rows, err := tx.Query(ctx, `SELECT version FROM `+versionTable)
	if err != nil {
		return fmt.Errorf("dedupactivity: migrate: read versions: %w", err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return fmt.Errorf("dedupactivity: migrate: read versions: %w", err)
	}
	for _, v := range versions {
		applied[v] = true
	}
	for _, m := range migs {
		if applied[m.Version] {
			continue
		}
		sql := strings.ReplaceAll(m.Up, migrations.TableToken, d.opts.Table)
		if _, err := tx.Exec(ctx, sql); err != nil {
			return fmt.Errorf("dedupactivity: migrate: apply %03d_%s: %w", m.Version, m.Name, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+versionTable+` (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
			return fmt.Errorf("dedupactivity: migrate: record %03d_%s: %w", m.Version, m.Name, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("dedupactivity: migrate: commit: %w", err)
	}
	if d.opts.PartitionInterval > 0 {
		if _, err := d.EnsurePartitions(ctx); err != nil {
			return err
		}
	}
	return nil
}

// lockKey is the advisory lock key of this Deduper's table.
func (d *Deduper) lockKey() int64 { return int64(d.tableKey("migrate")) }
