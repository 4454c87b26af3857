// Package migrations holds the versioned SQL that creates the dedupactivity
// marker table.
//
// Files are named NNN_name.up.sql / NNN_name.down.sql and use the table name
// dedup_marker unqualified, so they can be applied as they are by common
// migration tools (golang-migrate, goose with its own version table, psql).
// [github.com/dedupactivity/dedupactivity/dedupactivity.Deduper.Migrate] applies
// them with a version table and an advisory lock, replacing the table name
// with the one configured in its Options.
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
