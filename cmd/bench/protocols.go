package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// Names of the rows the report computes with.
const (
	nameBare            = "bare"
	nameDedup           = "dedupactivity"
	nameDedupKey        = "dedupactivity, business key"
	nameDedupNoRes      = "dedupactivity, results discarded"
	nameSeed            = "seed recipe (plain pgx)"
	nameStatus          = "status-record"
	nameCheckInsert     = "check-then-insert"
	nameFloor           = "floor: key insert only"
	nameByHand          = "by hand: dedupactivity's SQL"
	nameByHandNoLook    = "by hand: dedupactivity's SQL, no look"
	nameByHandRideNoIdx = "by hand: dedupactivity's SQL, no expiry index"
	nameByHandFirst     = "by hand: claim first"
	nameByHandNoIdx     = "by hand: claim first, no expiry index"
	nameByHandNoWait    = "by hand: claim first, no claim wait"
)

// runScoped is the run-scoped identity of the bench event key: what a
// wrapped activity derives from its workflow run by default.
func runScoped(key string) dedupactivity.Identity {
	return dedupactivity.Identity{Kind: dedupactivity.KindActivity, Namespace: "default",
		WorkflowID: "transfer-" + key, RunID: "6f1c2a3e-9b7d-4c21-8a55-4d2e1f0a9b8c", ActivityID: "5"}
}

// seedRecipe is the method note's recipe as a team would write it with pgx:
// BeginTx; INSERT ... ON CONFLICT DO NOTHING RETURNING on a text key; the
// effect only if a row came back; Commit.
func (b *bench) seedRecipe(ctx context.Context, key string, in posting) (bool, error) {
	tx, err := b.pool.BeginTx(ctx, pgx.TxOptions{})
	if err != nil {
		return false, err
	}
	defer tx.Rollback(ctx) // no-op after Commit
	var got string
	err = tx.QueryRow(ctx, `INSERT INTO processed_events (event_id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING event_id`, key).Scan(&got)
	if errors.Is(err, pgx.ErrNoRows) {
		return true, tx.Commit(ctx)
	}
	if err != nil {
		return false, err
	}
	if _, err := b.effect(ctx, tx, in); err != nil {
		return false, err
	}
	return false, tx.Commit(ctx)
}

// begin acquires a connection and starts a batch with BEGIN, as
// dedupactivity pipelines it.
func (b *bench) begin(ctx context.Context) (*pgxpool.Conn, *pgx.Batch, error) {
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return nil, nil, err
	}
	batch := &pgx.Batch{}
	batch.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	return conn, batch, nil
}

// claimSQL is dedupactivity's claim statement on table (copied from
// dedupactivity/store.go).
func claimSQL(table string) string {
	return `INSERT INTO ` + table + ` (id_hash, attempt, expires_at, activity_type, fingerprint, result)
SELECT $1::bytea, $2::int4, $3::timestamptz, $4::text, $5::bytea, $6::bytea
WHERE (set_config('dedupactivity.lock_timeout', current_setting('lock_timeout'), true) || set_config('lock_timeout', $7, true)) IS NOT NULL
ON CONFLICT DO NOTHING
RETURNING ctid, pg_current_xact_id()::text, set_config('lock_timeout', current_setting('dedupactivity.lock_timeout'), true), ` + self(table)
}

// self is the OID of table, which the statements after the effect compare
// with the claim's (dedupactivity/store.go).
func self(table string) string { return `'` + table + `'::regclass::oid` }

// sameTable fails the statement when table names another table than oid $n
// (dedupactivity/store.go), through dedup_marker's function (the by-hand
// rows' tables are copies of dedup_marker's table alone).
func sameTable(table, n string) string {
	return `CASE WHEN ` + self(table) + ` = ` + n + `::oid THEN true ELSE "dedup_marker_moved"() END`
}

// byHandOn issues dedupactivity's claim SQL (the statements of
// dedupactivity/store.go, copied) as a claim that goes before the effect (a
// retry's or a business key's), with no Go side around it: no identity
// encoding, telemetry or result encoding through a DataConverter. On
// another marker table, with or without the claim wait (the lock_timeout set
// and restored inside the insert), it measures what those cost.
func (b *bench) byHandOn(ctx context.Context, table string, claimWait bool, key string, in posting) (bool, error) {
	h := runScoped(key).Hash()
	conn, batch, err := b.begin(ctx)
	if err != nil {
		return false, err
	}
	defer conn.Release()
	if claimWait {
		batch.Queue(claimSQL(table),
			h[:], int32(1), time.Now().Add(30*24*time.Hour), "Post", nil, nil, "30000ms")
	} else {
		batch.Queue(`INSERT INTO `+table+` (id_hash, attempt, expires_at, activity_type, fingerprint, result)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT DO NOTHING
RETURNING ctid, NULL::text, NULL::text, `+self(table), h[:], int32(1), time.Now().Add(30*24*time.Hour), "Post", nil, nil)
	}
	br := conn.SendBatch(ctx, batch)
	tx := br.Tx()
	if _, err := br.Exec(); err != nil {
		return false, errors.Join(err, br.Close())
	}
	var ctid pgtype.TID
	var oid uint32
	if err := br.QueryRow().Scan(&ctid, nil, nil, &oid); errors.Is(err, pgx.ErrNoRows) {
		_ = br.Close()
		return true, tx.Rollback(ctx) // a duplicate
	} else if err != nil {
		return false, errors.Join(err, br.Close())
	}
	if err := br.Close(); err != nil {
		return false, err
	}
	r, err := b.effect(ctx, tx, in)
	if err != nil {
		_ = tx.Rollback(ctx)
		return false, err
	}
	batch = &pgx.Batch{}
	batch.Queue(`UPDATE `+table+` SET result = $2 WHERE ctid = $1 AND xmin = pg_current_xact_id()::xid AND `+sameTable(table, "$3"), ctid, encode(r), oid)
	batch.Queue("COMMIT")
	return false, conn.SendBatch(ctx, batch).Close()
}

// floor is a bound, not an approach: the effect plus the least a claim-first
// design that keeps a durable row per event can write, a 32-byte key into a
// one-index table, pipelined with BEGIN; no result, identity, expiry or
// claim wait (a duplicate fails on the key).
func (b *bench) floor(ctx context.Context, key string, in posting) (bool, error) {
	h := runScoped(key).Hash()
	conn, batch, err := b.begin(ctx)
	if err != nil {
		return false, err
	}
	defer conn.Release()
	batch.Queue(`INSERT INTO floor_key (id_hash) VALUES ($1)`, h[:])
	br := conn.SendBatch(ctx, batch)
	tx := br.Tx()
	if err := br.Close(); sqlState(err) == "23505" {
		return true, tx.Rollback(ctx) // a duplicate
	} else if err != nil {
		return false, fmt.Errorf("floor key: %w", err)
	}
	if _, err := b.effect(ctx, tx, in); err != nil {
		_ = tx.Rollback(ctx)
		return false, err
	}
	return false, tx.Commit(ctx)
}

// byHand issues dedupactivity's SQL as the dedupactivity row sends it (a
// run-scoped first attempt): BEGIN and a look for a committed marker ride
// with the effect's first statement, and the whole marker, result included,
// is inserted with COMMIT. With no Go side around it, against the
// dedupactivity row it shows what the library's Go side costs.
func (b *bench) byHand(ctx context.Context, key string, in posting) (bool, error) {
	return b.byHandOf(ctx, `"dedup_byhand"`, true, key, in)
}

// byHandOf is byHand on another marker table, with or without the look: it
// measures what the look and the expiry index cost a riding delivery.
// Without the look a duplicate would run the whole effect before its marker
// insert fails on the key, and a read-only session would show only as the
// effect's own errors: see docs/design.md.
func (b *bench) byHandOf(ctx context.Context, table string, look bool, key string, in posting) (bool, error) {
	h := runScoped(key).Hash()
	conn, batch, err := b.begin(ctx)
	if err != nil {
		return false, err
	}
	defer conn.Release()
	if look {
		batch.Queue(`SELECT EXISTS (SELECT FROM `+table+` WHERE id_hash = $1), current_setting('transaction_read_only') = 'on', `+self(table), h[:])
	}
	var r receipt
	batch.Queue(insertLedgerSQL, in.Key, in.Account, in.Amount)
	br := conn.SendBatch(ctx, batch)
	tx := br.Tx()
	if _, err := br.Exec(); err != nil {
		return false, errors.Join(err, br.Close())
	}
	var found bool
	var oid uint32
	if look {
		if err := br.QueryRow().Scan(&found, nil, &oid); err != nil {
			return false, errors.Join(err, br.Close())
		}
	}
	if found {
		_ = br.Close()
		return true, tx.Rollback(ctx)
	}
	if err := br.QueryRow().Scan(&r.EntryID); err != nil {
		return false, errors.Join(err, br.Close())
	}
	if err := br.Close(); err != nil {
		return false, err
	}
	if r, err = b.effectFrom(ctx, tx, in, r, 1); err != nil {
		_ = tx.Rollback(ctx)
		return false, err
	}
	insert := `INSERT INTO ` + table + ` (id_hash, attempt, expires_at, activity_type, fingerprint, result)
SELECT $1::bytea, $2::int4, $3::timestamptz, $4::text, $5::bytea, $6::bytea
WHERE set_config('lock_timeout', $7, true) IS NOT NULL`
	args := []any{h[:], int32(1), time.Now().Add(30 * 24 * time.Hour), "Post", nil, encode(r), "30000ms"}
	if look { // the table the look read
		insert += " AND " + sameTable(table, "$8")
		args = append(args, oid)
	}
	batch = &pgx.Batch{}
	batch.Queue(insert, args...)
	batch.Queue("COMMIT")
	err = conn.SendBatch(ctx, batch).Close()
	if sqlState(err) == "23505" {
		return true, tx.Rollback(ctx)
	}
	return false, err
}

func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}
