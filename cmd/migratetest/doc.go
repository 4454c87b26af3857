// Package migratetest checks that a migration tool applies the SQL files of
// the migrations package as they are: golang-migrate v4, reading the embedded
// files through its io/fs source, with its pgx v5 database driver. It has
// tests only; it keeps golang-migrate out of the library package's test
// imports.
package migratetest
