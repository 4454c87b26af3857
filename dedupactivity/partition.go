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

// attachAhead is how far ahead of now a range must start for its partition
// to be made as a table of its own and then attached. ATTACH PARTITION
// takes a lock on the table that claims do not conflict with (SHARE UPDATE
// EXCLUSIVE, not CREATE TABLE ... PARTITION OF's ACCESS EXCLUSIVE), and
// ACCESS EXCLUSIVE on the default partition, which only claims routed there
// hold (a first attempt's look is planned for its parameters, so it locks
// its own partition alone: see store.lookPlans). A claim routed to
// the default partition while it runs would fail on the new range's row:
// so only ranges no delivery can be scheduled in yet are made that way,
// with a minute's margin for the clocks of the workers, the Temporal server
// and PostgreSQL.
const attachAhead = time.Minute

// ensurePartitions creates, in the partitioned layout, the partitions
// covering the current interval and the next PartitionsAhead ones (those
// that do not exist yet). A range whose rows already sit in the default
// partition (maintenance fell behind) is left to the default partition:
// that is read first, without the table lock, since the CREATE would fail
// on them (an ERROR in the server log at each Prune) after reading the
// default partition while holding the lock claims wait for. It returns how
// many partitions it created; in the default layout it does nothing.
//
// A partition whose lock was not granted within partitionLockTimeout (a
// claim, or a reader, held the table that long) is left to the next run,
// unless its range starts within the next PartitionInterval: then the error
// is returned, so that the run fails and is retried before deliveries go to
// the default partition.
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
	now := time.Now()
	start := now.Truncate(iv)
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
		ddl := []string{d.store.createPartition(d.qualify(name), lo, lo.Add(iv))}
		if lo.After(now.Add(attachAhead)) {
			ddl = d.store.attachPartition(d.qualify(name), lo, lo.Add(iv))
		}
		err := d.maintain(ctx, func(tx pgx.Tx) error {
			for _, sql := range ddl {
				if _, err := tx.Exec(ctx, sql); err != nil {
					return err
				}
			}
			return nil
		})
		switch state := sqlState(err); {
		case err == nil:
			created++
		case state == stateDuplicateTable, state == stateUniqueViolation:
			// Another worker made it, unless no partition has the name: a
			// table left by hand (detached, say), which every run would
			// pass over while the range's markers go to the default
			// partition.
			if d.gone(ctx, name) {
				return created, fmt.Errorf("dedupactivity: create partition %s: a table of that name is there and is not a partition of %s (detached by hand?): attach or drop it: %w", name, d.store.table, err)
			}
		case state == stateCheckViolation: // rows came to the default partition since it was read: leave the range there
		case state == stateLockNotAvailable && lo.After(now.Add(iv)): // next run
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

// inISODateStyle runs fn in a transaction whose DateStyle is ISO, for
// statements that read partition bounds back from their text (see
// listPartitionsSQL).
func (d *Deduper) inISODateStyle(ctx context.Context, fn func(pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, d.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, setLocalISODateStyleSQL); err != nil {
			return err
		}
		return fn(tx)
	})
}

// partitions lists the range partitions (not the default one), in a
// transaction whose DateStyle is ISO (see listPartitionsSQL).
func (d *Deduper) partitions(ctx context.Context) ([]partition, error) {
	var out []partition
	err := d.inISODateStyle(ctx, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, listPartitionsSQL, d.store.table)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var name string
			var lo, hi *float64
			if err := rows.Scan(&name, &lo, &hi); err != nil {
				return err
			}
			if lo == nil || hi == nil {
				continue // the default partition
			}
			out = append(out, partition{name: name, lo: time.Unix(int64(*lo), 0), hi: time.Unix(int64(*hi), 0)})
		}
		return rows.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("dedupactivity: list partitions: %w", interpretError(err, false))
	}
	return out, nil
}

// dropExpiredPartitions drops range partitions whose scheduled-time range is
// over and whose markers have all expired. Each is first read without any
// lock, stopping at its first live marker, so a partition still in its
// retention (most of them) is passed over without blocking claims. One that
// looks expired is checked again in a transaction that holds the
// partition's own lock, which only claims of its range (deliveries
// scheduled that long ago) wait for (a result update is planned for its
// parameters in this layout, so it locks its own partition alone), and then
// detached and dropped: the table's lock, which every claim waits for, is
// held for the detach and the drop alone, which read no rows. A claim of
// the partition's range that holds the table's lock meanwhile ends the
// transaction at its lock timeout, and the partition is left to the next
// run. progress (if not nil) is called with the count so far before each
// past partition is read; once late says so, no more is read. A partition
// that cannot be read or dropped does not stop the others: their errors
// are returned together.
func (d *Deduper) dropExpiredPartitions(ctx context.Context, progress func(deleted int64), late func() bool) (int64, error) {
	parts, err := d.partitions(ctx)
	if err != nil {
		return 0, err
	}
	var deleted int64
	var errs []error
	for _, p := range parts {
		if p.hi.After(time.Now()) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return deleted, errors.Join(append(errs, err)...)
		}
		if late() {
			break
		}
		if progress != nil {
			progress(deleted)
		}
		var live bool
		if err := d.pool.QueryRow(ctx, anyLiveSQL(d.qualify(p.name))).Scan(&live); err != nil {
			if sqlState(err) == stateUndefinedTable && d.gone(ctx, p.name) {
				continue // another pruner dropped it since the list was read
			}
			errs = append(errs, fmt.Errorf("dedupactivity: read partition %s: %w", p.name, interpretError(err, false)))
			continue
		}
		if live {
			continue
		}
		var rows int64
		errKeep := errors.New("keep")
		err := d.maintain(ctx, func(tx pgx.Tx) error {
			name := d.qualify(p.name)
			if _, err := tx.Exec(ctx, lockPartitionSQL(name)); err != nil {
				return err
			}
			var live bool
			if err := tx.QueryRow(ctx, countLiveSQL(name)).Scan(&rows, &live); err != nil {
				return err
			}
			if live {
				return errKeep // roll back: the partition stays attached
			}
			if _, err := tx.Exec(ctx, d.store.detachPartition(name)); err != nil {
				return err
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
			errs = append(errs, fmt.Errorf("dedupactivity: drop partition %s: %w", p.name, err))
		}
	}
	return deleted, errors.Join(errs...)
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
