// Package outbox holds the versioned SQL that creates the transactional
// outbox table of [github.com/dedupactivity/dedupactivity/dedupactivity/outbox].
//
// Files are named NNN_name.up.sql / NNN_name.down.sql and use the table name
// "dedup_outbox" unqualified and quoted (TableToken, replaced, may be a
// reserved word), so common migration tools can apply them as they are.
// outbox.Outbox.Migrate applies them under an advisory lock with a version
// table, replacing the table name with the configured one.
package outbox

import "embed"

// FS holds every *.sql file of this directory.
//
//go:embed *.sql
var FS embed.FS

// TableToken is the table name the SQL files use (also the prefix of every
// index and constraint name).
const TableToken = "dedup_outbox"
