// Package migrations holds the versioned SQL that creates the dedupactivity
// marker table.
//
// Files are named NNN_name.up.sql / NNN_name.down.sql, are idempotent, and
// quote every name, with the table name dedup_marker as a token. They can be
// applied as they are by golang-migrate (tested in cmd/migratetest) and
// psql; goose needs its -- +goose annotations, which the files do not have.
// [github.com/dedupactivity/dedupactivity/dedupactivity.Deduper.Migrate]
// applies them with a version table and an advisory lock, replacing the
// token with the table name configured in its Options, and does nothing when
// the table is already there.
package migrations

import "embed"

// FS holds every *.sql file of this directory (the default layout).
//
//go:embed *.sql
var FS embed.FS

// PartitionedFS holds the partitioned layout's files, under partitioned/.
//
//go:embed partitioned/*.sql
var PartitionedFS embed.FS

// TableToken is the table name the SQL files use. A migrator that wants
// another table name replaces this token (it is also the prefix of every index
// name, so indexes follow the table).
const TableToken = "dedup_marker"
