// Package ledger holds the schema of the example ledger (activities and
// workflows packages): accounts and their ledger entries. It is separate from
// the marker table's migrations, which belong to the library.
package ledger

import "embed"

// FS holds the NNN_name.up.sql / .down.sql files of the ledger schema.
//
//go:embed *.sql
var FS embed.FS
