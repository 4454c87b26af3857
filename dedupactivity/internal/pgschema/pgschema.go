// Package pgschema creates the schema that the dedupactivity packages'
// Migrate functions make their tables in.
package pgschema

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Querier is what Ensure needs of a pool or connection.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Ensure creates the schema name unless it exists, in a statement of its
// own: inside a migration's transaction it can fail with a
// unique_violation when another process created it while that one waited
// for its lock. The same schema created at once elsewhere
// (unique_violation, or duplicate_schema) has committed, which is all this
// asks. A schema that exists is not created again: CREATE SCHEMA IF NOT
// EXISTS checks the database's CREATE privilege before it looks, which a
// role that may create tables in the schema (one a DBA made) need not have.
func Ensure(ctx context.Context, q Querier, name string) error {
	schema := pgx.Identifier{name}.Sanitize()
	var exists bool
	if err := q.QueryRow(ctx, `SELECT to_regnamespace($1) IS NOT NULL`, schema).Scan(&exists); err != nil || exists {
		return err
	}
	_, err := q.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+schema)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "23505" || pgErr.Code == "42P06") { // unique_violation, duplicate_schema
		return nil
	}
	return err
}
