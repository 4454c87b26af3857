package main

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// Names of the reference rows the report computes with.
const (
	nameFloor      = "floor: key insert only"
	nameByHand     = "by hand: lock, effect, insert marker + result (this version)"
	nameLockOnly   = "by hand: lock and look only (no marker)"
	nameMarkerOnly = "by hand: marker + result insert only (no lock)"
)

// protocolApproaches are reference rows that issue dedupactivity's SQL by
// hand, without the library's Go side (fingerprint, result encoding,
// telemetry), on the same marker table: the claim of this version (lock and
// look in the BEGIN round trip, marker inserted with its result in the
// COMMIT round trip) and the claim before migration 003 (marker inserted in
// the BEGIN round trip, result stored by an UPDATE in the COMMIT round trip).
// Side by side they show what writing the marker once is worth; against the
// dedupactivity row, what the library's Go side costs. Two more rows run
// each half of this version's claim alone with the effect, so the report
// can say where the cost over bare goes.
func (b *bench) protocolApproaches() []approach {
	type marker struct {
		hash, enc, fingerprint []byte
		lockKey                int64
	}
	newMarker := func(key string) marker {
		id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "bench", ActivityType: "Post", Key: key}
		h := id.Hash()
		fp := sha256.Sum256([]byte("input:" + key))
		return marker{hash: h[:], enc: id.Encode(), fingerprint: fp[:], lockKey: int64(binary.BigEndian.Uint64(h[:8]))}
	}
	// run begins with begin, applies the effect and commits with commit
	// (which gets the effect's result) in one pipelined round trip.
	run := func(ctx context.Context, begin string, in posting, commit func(b *pgx.Batch, result []byte)) error {
		conn, err := b.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		defer conn.Release()
		tx, err := conn.Conn().BeginTx(ctx, pgx.TxOptions{BeginQuery: begin})
		if err != nil {
			return err
		}
		r, err := b.effect(ctx, tx, in)
		if err != nil {
			_ = tx.Rollback(ctx)
			return err
		}
		batch := &pgx.Batch{}
		commit(batch, encode(r))
		batch.Queue("COMMIT")
		return conn.SendBatch(ctx, batch).Close()
	}
	lockSQL := func(m marker) string {
		return fmt.Sprintf(`BEGIN ISOLATION LEVEL READ COMMITTED; SELECT dedup_marker_lock(E'\\x%x'::bytea, %d, '30000ms')`, m.hash, m.lockKey)
	}
	insertMarker := func(m marker) func(batch *pgx.Batch, result []byte) {
		return func(batch *pgx.Batch, result []byte) {
			batch.Queue(`WITH i AS (INSERT INTO dedup_marker (id_hash, identity, activity_type, fingerprint, fingerprint_alg, attempt, result, expires_at)
	VALUES ($1, $2, 'Post', $3, 1, 1, $4, now() + interval '30 days') ON CONFLICT DO NOTHING RETURNING 1)
SELECT 1 / count(*) FROM i`, m.hash, m.enc, m.fingerprint, result)
		}
	}
	return []approach{
		{name: nameByHand, reference: true, deliver: func(ctx context.Context, key string, in posting) (bool, error) {
			m := newMarker(key)
			return false, run(ctx, lockSQL(m), in, insertMarker(m))
		}},
		// The two halves of the row above, each alone with the effect: what
		// the lock and look costs, and what writing the marker row costs.
		// Neither is safe by itself.
		{name: nameLockOnly, reference: true, deliver: func(ctx context.Context, key string, in posting) (bool, error) {
			return false, run(ctx, lockSQL(newMarker(key)), in, func(*pgx.Batch, []byte) {})
		}},
		{name: nameMarkerOnly, reference: true, deliver: func(ctx context.Context, key string, in posting) (bool, error) {
			return false, run(ctx, "BEGIN ISOLATION LEVEL READ COMMITTED", in, insertMarker(newMarker(key)))
		}},
		{name: "by hand: insert marker, effect, update result (before 003)", reference: true, deliver: func(ctx context.Context, key string, in posting) (bool, error) {
			m := newMarker(key)
			begin := fmt.Sprintf(`BEGIN ISOLATION LEVEL READ COMMITTED; SELECT dedup_marker_claim(E'\\x%x'::bytea, E'\\x%x'::bytea, 'Post', E'\\x%x'::bytea, 1::smallint, 1, 2592000, NULL::timestamptz, '30000ms')`, m.hash, m.enc, m.fingerprint)
			return false, run(ctx, begin, in, func(batch *pgx.Batch, result []byte) {
				batch.Queue(`WITH u AS (UPDATE dedup_marker SET result = $2 WHERE id_hash = $1 RETURNING 1) SELECT 1 / count(*) FROM u`, m.hash, result)
			})
		}},
	}
}
