package dedupactivity

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// partitionLockTimeout bounds how long partition maintenance waits for the
// table lock it needs; claims queue behind a waiting lock request, so it is
// kept short and the work is retried at the next run.
const partitionLockTimeout = 500 * time.Millisecond

// ensurePartitions creates, in the partitioned layout, the partitions
// covering the current interval and the next PartitionsAhead ones (those
// that do not exist yet). A range whose rows already sit in the default
// partition (maintenance fell behind) is left to the default partition:
// that is read first, without the table lock, since the CREATE would fail
// on them (an ERROR in the server log at each Prune) after reading the
// default partition while holding the lock claims wait for. It returns how
// many partitions it created; in the default layout it does nothing.
func (d *Deduper) ensurePartitions(ctx context.Context) (int, error) {
	iv := d.opts.PartitionInterval
	if iv <= 0 {
		return 0, nil
	}
	existing, err := d.partitions(ctx)
	if err != nil {
		return 0, err
	}
	have := map[string]bool{}
	for _, p := range existing {
		if w := p.hi.Sub(p.lo); w != iv {
			return 0, fmt.Errorf("%w: partition %s spans %s and PartitionInterval is %s: the table's partitions were made with another PartitionInterval; give Options the table's", ErrInvalidOptions, p.name, w, iv)
		}
		have[p.name] = true
	}
	created := 0
	start := time.Now().Truncate(iv)
	for i := 0; i <= d.opts.PartitionsAhead; i++ {
		lo := start.Add(time.Duration(i) * iv)
		name := d.opts.Table + "_p" + strconv.FormatInt(lo.Unix(), 10)
		if have[name] {
			continue
		}
		var behind bool
		if err := d.pool.QueryRow(ctx, d.store.inDefault, lo, lo.Add(iv)).Scan(&behind); err != nil {
			return created, fmt.Errorf("dedupactivity: read the default partition: %w", interpretError(err, false))
		}
		if behind {
			continue
		}
		sql := d.store.createPartition(d.qualify(name), lo, lo.Add(iv))
		err := d.maintain(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, sql)
			return err
		})
		switch state := sqlState(err); {
		case err == nil:
			created++
		case state == stateDuplicateTable: // another worker made it
		case state == stateCheckViolation: // rows came to the default partition since it was read: leave the range there
		case state == stateLockNotAvailable: // next run
		case state == stateInvalidObjectDefinition:
			return created, fmt.Errorf("%w: partition %s would overlap an existing one: the table's partitions were made with another PartitionInterval; give Options the table's: %w", ErrInvalidOptions, name, err)
		default:
			return created, fmt.Errorf("dedupactivity: create partition %s: %w", name, err)
		}
	}
	return created, nil
}

type partition struct {
	name   string
	lo, hi time.Time // its range: [lo, hi)
}

// partitions lists the range partitions (not the default one).
func (d *Deduper) partitions(ctx context.Context) ([]partition, error) {
	rows, err := d.pool.Query(ctx, listPartitionsSQL, d.store.table)
	if err != nil {
		return nil, fmt.Errorf("dedupactivity: list partitions: %w", interpretError(err, false))
	}
	defer rows.Close()
	var out []partition
	for rows.Next() {
		var name string
		var lo, hi *float64
		if err := rows.Scan(&name, &lo, &hi); err != nil {
			return nil, err
		}
		if lo == nil || hi == nil {
			continue // the default partition
		}
		out = append(out, partition{name: name, lo: time.Unix(int64(*lo), 0), hi: time.Unix(int64(*hi), 0)})
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("dedupactivity: list partitions: %w", interpretError(err, false))
	}
	return out, nil
}

// dropExpiredPartitions drops range partitions whose scheduled-time range is
// over and whose markers have all expired. Each is first read without the
// table lock, stopping at its first live marker, so a partition still in
// its retention (most of them) is passed over without blocking claims; one
// that looks expired is detached and checked again in one transaction
// holding the table lock, so no claim can insert into it between the check
// and the drop. progress (if not nil) is called with the count so far
// before each past partition is read.
func (d *Deduper) dropExpiredPartitions(ctx context.Context, progress func(deleted int64)) (int64, error) {
	parts, err := d.partitions(ctx)
	if err != nil {
		return 0, err
	}
	var deleted int64
	for _, p := range parts {
		if p.hi.After(time.Now()) {
			continue
		}
		if progress != nil {
			progress(deleted)
		}
		var live bool
		if err := d.pool.QueryRow(ctx, anyLiveSQL(d.qualify(p.name))).Scan(&live); err != nil {
			if sqlState(err) == stateUndefinedTable && d.gone(ctx, p.name) {
				continue // another pruner dropped it since the list was read
			}
			return deleted, fmt.Errorf("dedupactivity: read partition %s: %w", p.name, interpretError(err, false))
		}
		if live {
			continue
		}
		var rows int64
		errKeep := errors.New("keep")
		err := d.maintain(ctx, func(tx pgx.Tx) error {
			name := d.qualify(p.name)
			if _, err := tx.Exec(ctx, d.store.detachPartition(name)); err != nil {
				return err
			}
			var live bool
			if err := tx.QueryRow(ctx, countLiveSQL(name)).Scan(&rows, &live); err != nil {
				return err
			}
			if live {
				return errKeep // roll back: the partition stays attached
			}
			_, err := tx.Exec(ctx, dropTableSQL(name))
			return err
		})
		switch {
		case err == nil:
			deleted += rows
		case errors.Is(err, errKeep), sqlState(err) == stateLockNotAvailable:
		case sqlState(err) == stateUndefinedTable && d.gone(ctx, p.name):
			// Another pruner detached or dropped it meanwhile ("is not a
			// partition", or no such table).
		default:
			return deleted, fmt.Errorf("dedupactivity: drop partition %s: %w", p.name, err)
		}
	}
	return deleted, nil
}

// gone says whether the partition name is no longer attached to the marker
// table: another pruner detached it since the list was read. A partition
// still listed whose name does not resolve is an error of its own.
func (d *Deduper) gone(ctx context.Context, name string) bool {
	parts, err := d.partitions(ctx)
	return err == nil && !slices.ContainsFunc(parts, func(p partition) bool { return p.name == name })
}

// maintain runs fn in a transaction whose lock waits are bounded by
// partitionLockTimeout.
func (d *Deduper) maintain(ctx context.Context, fn func(pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, d.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, setLocalLockTimeoutSQL, string(appendLockTimeout(nil, partitionLockTimeout))); err != nil {
			return err
		}
		return fn(tx)
	})
}
