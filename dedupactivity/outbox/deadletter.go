package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// A dead message waits for the reconciler, or, once the reconciler reports
// it (out of re-queues, first sent longer ago than KeyRetention and not
// acknowledged since, a destination it cannot ask), for a person. These are
// that person's tools: list the dead letters, ask the destination, then
// re-queue, mark applied or mark rejected (docs/outbox.md, Dead letters). Each changes a message only while it is
// dead, so it cannot race a relay's send or the reconciler's own change.

// DeadLetter is a dead message, as DeadLetters lists it.
type DeadLetter struct {
	// Key, Destination and Name are the message's, as Enqueue stored them
	// (see Message).
	Key         string
	Destination string
	Name        string
	// Attempts counts every send of the message; Requeues the
	// reconciler's re-queues of it.
	Attempts, Requeues int
	// LastError is why the last send failed.
	LastError string
	// CreatedAt is when the message was enqueued (its effect committed);
	// DiedAt when it went dead.
	CreatedAt, DiedAt time.Time
	// UnackedSince is when its first send not acknowledged since began (or
	// its last re-queue, see Requeue), by the database's clock: every send
	// the destination may hold its key from reached it no earlier (a send
	// it was still finishing at a re-queue's question counts from the
	// question), so it keeps that key until at least UnackedSince plus its
	// retention; Requeue it only while that is ahead. Zero for a message
	// never sent.
	UnackedSince time.Time
}

// DeadLetters lists up to limit dead messages (at least 1), the longest
// dead first, through the dead messages' index.
func (ob *Outbox) DeadLetters(ctx context.Context, limit int) ([]DeadLetter, error) {
	if limit < 1 {
		return nil, fmt.Errorf("%w: DeadLetters limit must be at least 1, got %d", ErrInvalidConfig, limit)
	}
	rows, err := ob.pool.Query(ctx, `SELECT idempotency_key, destination, name, attempts, requeues, coalesce(last_error, ''),
	created_at, coalesce(settled_at, created_at), unacked_since
FROM `+ob.table+` WHERE state = 'dead' ORDER BY settled_at NULLS FIRST, id LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("outbox: dead letters: %w", translate(err))
	}
	letters, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (DeadLetter, error) {
		var l DeadLetter
		var unacked *time.Time
		err := row.Scan(&l.Key, &l.Destination, &l.Name, &l.Attempts, &l.Requeues, &l.LastError, &l.CreatedAt, &l.DiedAt, &unacked)
		if unacked != nil {
			l.UnackedSince = *unacked
		}
		return l, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: dead letters: %w", translate(err))
	}
	return letters, nil
}

// Requeue makes the dead message key due now, with a fresh budget of
// MaxAttempts sends (and of stalls: a message made dead because its sends
// kept stopping the relay is sent again, so re-queue it once that is
// fixed). Its re-queues by the reconciler stay counted. Requeue only what
// the destination has not applied, and within the time it keeps its keys:
// a destination that forgot the key applies the message again. A message
// sent before is unacknowledged from the Requeue on, as from a reconciler's
// re-queue: a send the destination had not finished when it was asked may
// be applied after, so the relay sends nothing once KeyRetention has passed
// since (see RelayConfig.KeyRetention). A message never sent (UnackedSince
// zero: one the relay made dead before a send began, for its headers, say,
// though its attempts count that claim) stays never sent, and is sent
// whatever the time since.
func (ob *Outbox) Requeue(ctx context.Context, key string) error {
	return ob.resolve(ctx, "requeue", key, `state = 'pending', tries = 0, stalls = 0, next_attempt_at = now(),
	settled_at = NULL, unacked_since = CASE WHEN unacked_since IS NOT NULL THEN now() END, checked_at = NULL, lease_until = NULL, in_send = false`)
}

// MarkApplied records that the dead message key was applied at its
// destination (a person asked it): applied, never sent again, pruned after
// Retention as a sent message.
func (ob *Outbox) MarkApplied(ctx context.Context, key string) error {
	return ob.resolve(ctx, "mark applied", key, `state = 'applied', settled_at = now(), lease_until = NULL, unacked_since = NULL, in_send = false`)
}

// MarkRejected records that the destination refused the dead message key
// for good: rejected, never sent or asked about again, pruned after
// Retention. reason replaces its last error (kept when reason is empty).
func (ob *Outbox) MarkRejected(ctx context.Context, key, reason string) error {
	if !storable(reason) {
		return fmt.Errorf("%w: reason is not valid UTF-8 without NUL", ErrInvalidConfig)
	}
	return ob.resolve(ctx, "mark rejected", key, `state = 'rejected', settled_at = now(), lease_until = NULL, unacked_since = NULL, in_send = false,
	last_error = coalesce(nullif($2, ''), last_error)`, reason)
}

// resolve applies set to the message key if it is dead, and otherwise
// says why not: no such message (ErrNoMessage), or its state (ErrNotDead).
func (ob *Outbox) resolve(ctx context.Context, op, key, set string, args ...any) error {
	tag, err := ob.pool.Exec(ctx, `UPDATE `+ob.table+` SET `+set+` WHERE idempotency_key = $1 AND state = 'dead'`, append([]any{key}, args...)...)
	if err != nil {
		return fmt.Errorf("outbox: %s %s: %w", op, key, translate(err))
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	var state string
	err = ob.pool.QueryRow(ctx, `SELECT state FROM `+ob.table+` WHERE idempotency_key = $1`, key).Scan(&state)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("outbox: %s %s: %w", op, key, ErrNoMessage)
	case err != nil:
		return fmt.Errorf("outbox: %s %s: %w", op, key, translate(err))
	}
	return fmt.Errorf("outbox: %s %s: %w: it is %s", op, key, ErrNotDead, state)
}
