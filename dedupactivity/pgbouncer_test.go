package dedupactivity_test

// Behind PgBouncer in transaction pooling mode (a real pgbouncer binary that
// internal/pgtest starts in front of the test server), with every pgx
// QueryExecMode. Effects are counted with SQL on the server itself, not
// through PgBouncer or the library.
//
// Two things users must know, both checked here:
//   - PgBouncer 1.18 refuses startup parameters it does not track, search_path
//     among them ("unsupported startup parameter"), so the pools here name
//     the marker table's schema with Options.Schema and the effects qualify
//     their tables.
//   - pgx's default QueryExecModeCacheStatement prepares named statements
//     ("stmtcache_<hash>") on one server connection and executes them by name
//     in later transactions, which PgBouncer may run on another: deliveries
//     fail with SQLSTATE 26000 (prepared statement does not exist) or 42P05
//     (already exists). Nothing is applied twice, since every failure rolls
//     the claim back, but the attempts fail. Set default_query_exec_mode=exec
//     (or cache_describe, simple_protocol) in the connection string, or
//     ConnConfig.DefaultQueryExecMode. describe_exec works for claims but not
//     for calls outside a transaction (docs/pgbouncer.md).

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

// bouncerModes are the exec modes in which claims work behind PgBouncer
// 1.18 in transaction mode, by their default_query_exec_mode
// connection-string value. describe_exec fails outside a transaction (see
// docs/pgbouncer.md), so the docs do not recommend it.
var bouncerModes = map[string]pgx.QueryExecMode{
	"exec":            pgx.QueryExecModeExec,
	"simple_protocol": pgx.QueryExecModeSimpleProtocol,
	"describe_exec":   pgx.QueryExecModeDescribeExec,
	"cache_describe":  pgx.QueryExecModeCacheDescribe,
}

type bouncerBundle struct {
	*testBundle
	bouncer *pgtest.PgBouncer
}

// setupBouncer gives the test its schema (marker table, ledger) on the
// server and a PgBouncer of its own in front of the server.
func setupBouncer(t *testing.T, settings ...string) *bouncerBundle {
	t.Helper()
	b := setup(t, dedupactivity.Options{})
	return &bouncerBundle{testBundle: b, bouncer: pgtest.NewPgBouncer(t, settings...)}
}

// bouncerPool connects through PgBouncer with the exec mode named as in a
// connection string (mode "" leaves pgx's default, CacheStatement).
func (b *bouncerBundle) bouncerPool(t *testing.T, mode string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	url := b.bouncer.URL
	if mode != "" {
		url += "&default_query_exec_mode=" + mode
	}
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	if m, ok := bouncerModes[mode]; ok {
		require.Equal(t, m, cfg.ConnConfig.DefaultQueryExecMode)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// deduper makes a Deduper on pool for the test's schema, which it names
// (no search_path through PgBouncer).
func (b *bouncerBundle) deduper(t *testing.T, pool *pgxpool.Pool, opts dedupactivity.Options) *dedupactivity.Deduper {
	t.Helper()
	opts.Schema = b.schema.Name
	d, err := dedupactivity.New(pool, opts)
	require.NoError(t, err)
	return d
}

// Recorded is the result of the record effect.
type Recorded struct {
	EntryID int64
	Backend uint32 // the server backend that ran the effect
}

// record is the effect: one ledger row for the event, named by account, and
// a sleep that keeps the transaction open long enough for concurrent
// deliveries to meet.
func (b *bouncerBundle) record(sleep time.Duration) dedupactivity.EffectFunc[Transfer, Recorded] {
	ledger := pgx.Identifier{b.schema.Name, "ledger"}.Sanitize()
	return func(ctx context.Context, tx pgx.Tx, in Transfer) (Recorded, error) {
		b.effects.Add(1)
		var p Recorded
		err := tx.QueryRow(ctx, `INSERT INTO `+ledger+` (account, amount) VALUES ($1, $2) RETURNING id, pg_backend_pid()`, in.Account, in.Amount).Scan(&p.EntryID, &p.Backend)
		if err == nil && sleep > 0 {
			_, err = tx.Exec(ctx, `SELECT pg_sleep($1)`, sleep.Seconds())
		}
		return p, err
	}
}

// rows counts the ledger rows and markers of key on the server.
func (b *bouncerBundle) rows(t *testing.T, key string) (ledger, markers int64) {
	t.Helper()
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Record", Key: key}
	return b.count(t, `SELECT count(*) FROM ledger WHERE account = $1`, key),
		b.count(t, `SELECT count(*) FROM dedup_marker WHERE id_hash = $1`, hashOf(id))
}

func recordID(key string) dedupactivity.Identity {
	return dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Record", Key: key}
}

// requireTransactionPooling checks that pool's connections share server
// connections between transactions: two client connections held at once
// see one backend.
func requireTransactionPooling(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	c1, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer c1.Release()
	c2, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer c2.Release()
	var pid1, pid2 uint32
	require.NoError(t, c1.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid1))
	require.NoError(t, c2.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid2))
	require.Equal(t, pid1, pid2, "two client connections should run on one server connection (transaction pooling)")
}

// TestPgBouncerTransactionPooling: through PgBouncer in transaction pooling
// mode, with every exec mode that can work there, claims, duplicates
// (returning the stored result), business-key mismatches, concurrent
// deliveries of one event (exactly one effect) and claim timeouts behave as
// on a direct connection, and the claim's lock_timeout does not leak to
// other clients of the server connection.
func TestPgBouncerTransactionPooling(t *testing.T) {
	t.Parallel()
	b := setupBouncer(t, "default_pool_size = 8")
	ctx := context.Background()
	requireTransactionPooling(t, b.bouncerPool(t, "exec", 2))

	// Hence Options.Schema and qualified tables below.
	_, err := pgx.Connect(ctx, b.bouncer.URL+"&search_path="+b.schema.Name)
	require.ErrorContains(t, err, "unsupported startup parameter: search_path")

	t.Run("modes", func(t *testing.T) {
		for mode := range bouncerModes {
			t.Run(mode, func(t *testing.T) {
				t.Parallel()
				// More client connections than PgBouncer has server
				// connections for all four modes together.
				pool := b.bouncerPool(t, mode, 10)
				d := b.deduper(t, pool, dedupactivity.Options{})

				t.Run("ClaimDuplicateMismatch", func(t *testing.T) {
					key := "cdm-" + mode
					in := Transfer{Account: key, Amount: 3}
					first, outcome, err := dedupactivity.Do(ctx, d, recordID(key), in, b.record(0))
					require.NoError(t, err)
					require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
					dup, outcome, err := dedupactivity.Do(ctx, d, recordID(key), in, b.record(0))
					require.NoError(t, err)
					require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
					require.Equal(t, first, dup, "a duplicate returns the stored result")
					_, outcome, err = dedupactivity.Do(ctx, d, recordID(key), Transfer{Account: key, Amount: 4}, b.record(0))
					require.ErrorIs(t, err, dedupactivity.ErrPayloadMismatch)
					require.Equal(t, dedupactivity.OutcomePayloadMismatch, outcome)
					ledger, markers := b.rows(t, key)
					require.Equal(t, int64(1), ledger)
					require.Equal(t, int64(1), markers)
					require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM ledger WHERE id = $1 AND amount = 3`, first.EntryID))
				})

				// Migrate, Applied, Result and Prune run outside a
				// transaction, in the modes docs/pgbouncer.md recommends:
				// describe_exec is not one, since there its describe and
				// its execution may reach two server connections (26000).
				t.Run("OutsideATransaction", func(t *testing.T) {
					if mode == "describe_exec" {
						return // not claimed to work (see above)
					}
					var wg sync.WaitGroup
					errs := make([]error, 6)
					for i := range errs {
						wg.Add(1)
						go func() {
							defer wg.Done()
							errs[i] = d.Migrate(ctx)
						}()
					}
					wg.Wait()
					for i, err := range errs {
						require.NoError(t, err, "Migrate %d", i)
					}

					key := "outside-" + mode
					in := Transfer{Account: key, Amount: 2}
					first, _, err := dedupactivity.Do(ctx, d, recordID(key), in, b.record(0))
					require.NoError(t, err)
					for range 3 { // more than one server connection
						applied, err := d.Applied(ctx, recordID(key))
						require.NoError(t, err)
						require.True(t, applied)
						var stored Recorded
						applied, err = d.Result(ctx, recordID(key), &stored)
						require.NoError(t, err)
						require.True(t, applied)
						require.Equal(t, first, stored)
					}

					_, err = b.pool.Exec(ctx, `UPDATE dedup_marker SET expires_at = now() - interval '1 hour' WHERE id_hash = $1`, hashOf(recordID(key)))
					require.NoError(t, err)
					_, err = d.Prune(ctx)
					require.NoError(t, err)
					_, markers := b.rows(t, key)
					require.Zero(t, markers, "pruned through PgBouncer")
				})

				t.Run("ConcurrentDeliveries", func(t *testing.T) {
					const n = 10
					key := "conc-" + mode
					in := Transfer{Account: key, Amount: 5}
					var (
						wg       sync.WaitGroup
						gate     = make(chan struct{})
						results  [n]Recorded
						outcomes [n]dedupactivity.Outcome
						errs     [n]error
					)
					for i := range n {
						wg.Add(1)
						go func() {
							defer wg.Done()
							<-gate
							results[i], outcomes[i], errs[i] = dedupactivity.Do(ctx, d, recordID(key), in, b.record(100*time.Millisecond))
						}()
					}
					close(gate)
					wg.Wait()
					claimed := 0
					for i := range n {
						require.NoError(t, errs[i], "delivery %d", i)
						if outcomes[i] == dedupactivity.OutcomeClaimed {
							claimed++
						} else {
							require.Equal(t, dedupactivity.OutcomeDuplicate, outcomes[i], "delivery %d", i)
						}
						require.Equal(t, results[0], results[i], "delivery %d", i)
					}
					require.Equal(t, 1, claimed)
					ledger, markers := b.rows(t, key)
					require.Equal(t, int64(1), ledger, "exactly one effect")
					require.Equal(t, int64(1), markers)
				})

				t.Run("ClaimTimeout", func(t *testing.T) {
					key := "timeout-" + mode
					in := Transfer{Account: key, Amount: 7}
					holderD := b.deduper(t, pool, dedupactivity.Options{})
					holding, release := make(chan struct{}), make(chan struct{})
					dedupactivity.SetAfterClaimHook(holderD, func(context.Context, pgx.Tx) error {
						close(holding)
						<-release
						return nil
					})
					holder := make(chan error, 1)
					go func() {
						_, outcome, err := dedupactivity.Do(ctx, holderD, recordID(key), in, b.record(0))
						if err == nil && outcome != dedupactivity.OutcomeClaimed {
							err = fmt.Errorf("holder's outcome %s", outcome)
						}
						holder <- err
					}()
					<-holding

					waiter := b.deduper(t, pool, dedupactivity.Options{ClaimWait: 300 * time.Millisecond})
					began := time.Now()
					_, outcome, err := dedupactivity.Do(ctx, waiter, recordID(key), in, b.record(0))
					require.ErrorIs(t, err, dedupactivity.ErrClaimTimeout)
					require.Equal(t, dedupactivity.OutcomeClaimTimeout, outcome)
					require.GreaterOrEqual(t, time.Since(began), 300*time.Millisecond)
					require.Less(t, time.Since(began), 5*time.Second)

					close(release)
					require.NoError(t, <-holder)
					_, outcome, err = dedupactivity.Do(ctx, waiter, recordID(key), in, b.record(0))
					require.NoError(t, err)
					require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
					ledger, markers := b.rows(t, key)
					require.Equal(t, int64(1), ledger)
					require.Equal(t, int64(1), markers)
				})
			})
		}
	})

	// The claims set lock_timeout for their transaction only: every server
	// connection PgBouncer holds (at most default_pool_size, all busy at once
	// here) still has the server's default.
	pool := b.bouncerPool(t, "exec", 16)
	var wg sync.WaitGroup
	settings := make([]string, 16)
	errs := make([]error, 16)
	for i := range settings {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = pool.QueryRow(ctx, `SELECT current_setting('lock_timeout') FROM pg_sleep(0.2)`).Scan(&settings[i])
		}()
	}
	wg.Wait()
	for i := range settings {
		require.NoError(t, errs[i])
		require.Equal(t, "0", settings[i], "lock_timeout on a server connection after the claims")
	}
}

// TestPgBouncerCacheStatement: pgx's default exec mode, CacheStatement,
// does not work behind PgBouncer 1.18 in transaction mode, and fails
// clearly and harmlessly: a statement pgx prepared by name on one server
// connection is executed in a later transaction that PgBouncer runs on
// another (SQLSTATE 26000), or prepared again where another client already
// did (42P05); the failed attempt rolls back, so no effect is applied twice
// or without its marker. The claim's own statements, which it prepares by
// name too, are prepared again when the first round trip finds them
// missing (nothing of it ran), so a delivery fails only on the effect's.
func TestPgBouncerCacheStatement(t *testing.T) {
	t.Parallel()
	b := setupBouncer(t, "default_pool_size = 2")
	ctx := context.Background()

	t.Run("StatementOnAnotherServerConnection", func(t *testing.T) {
		cached := b.bouncerPool(t, "", 1)
		require.Equal(t, pgx.QueryExecModeCacheStatement, cached.Config().ConnConfig.DefaultQueryExecMode)
		d := b.deduper(t, cached, dedupactivity.Options{})
		key := "moved"
		in := Transfer{Account: key, Amount: 1}
		// Alone, the client gets the same server connection every time.
		first, outcome, err := dedupactivity.Do(ctx, d, recordID(key), in, b.record(0))
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome)

		// Another client holds that server connection in a transaction
		// (PgBouncer hands out idle server connections last in, first out).
		other := b.bouncerPool(t, "exec", 1)
		tx, err := other.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx)
		var pid uint32
		require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
		require.Equal(t, first.Backend, pid, "the other client should hold the server connection the first delivery ran on")

		// The duplicate runs on the other server connection, where the
		// claim's statements were never prepared: it prepares them there
		// and returns the stored result.
		dup, outcome, err := dedupactivity.Do(ctx, d, recordID(key), in, b.record(0))
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
		require.Equal(t, first, dup)
		// A new event there: the effect's statement, which pgx cached on
		// the first server connection, is missing.
		_, outcome, err = dedupactivity.Do(ctx, d, recordID(key+"-2"), in, b.record(0))
		requirePreparedStatementError(t, err)
		require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
		require.NoError(t, tx.Rollback(ctx))
		ledger, markers := b.rows(t, key)
		require.Equal(t, int64(1), ledger)
		require.Equal(t, int64(1), markers)
		ledger, markers = b.rows(t, key+"-2")
		require.Zero(t, ledger)
		require.Zero(t, markers)
	})

	t.Run("ManyClients", func(t *testing.T) {
		cached := b.bouncerPool(t, "", 8)
		d := b.deduper(t, cached, dedupactivity.Options{})
		const workers, each, keys = 8, 12, 4
		var (
			mu       sync.Mutex
			failures []error
			applied  = map[string]bool{} // keys some delivery returned a result for
			wg       sync.WaitGroup
		)
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range each {
					key := fmt.Sprintf("many-%d", (w+i)%keys)
					_, _, err := dedupactivity.Do(ctx, d, recordID(key), Transfer{Account: key, Amount: 1}, b.record(0))
					mu.Lock()
					if err != nil {
						failures = append(failures, err)
					} else {
						applied[key] = true
					}
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		require.NotEmpty(t, failures, "CacheStatement behind transaction pooling should fail")
		for _, err := range failures {
			requirePreparedStatementError(t, err)
		}
		for k := range keys {
			key := fmt.Sprintf("many-%d", k)
			ledger, markers := b.rows(t, key)
			require.LessOrEqual(t, ledger, int64(1), "key %s applied more than once", key)
			require.Equal(t, ledger, markers, "key %s: effect and marker commit together", key)
			if applied[key] {
				require.Equal(t, int64(1), ledger, "key %s returned a result", key)
			}
		}
		t.Logf("%d of %d deliveries failed; first: %v", len(failures), workers*each, failures[0])
	})
}

// requirePreparedStatementError checks that err is PostgreSQL's complaint
// about a named prepared statement (pgx's or the claim's) that is missing
// on, or already on, the server connection PgBouncer chose.
func requirePreparedStatementError(t *testing.T, err error) {
	t.Helper()
	require.Error(t, err)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "want a PostgreSQL error, got %v", err)
	require.Contains(t, []string{"26000", "42P05"}, pgErr.Code, "%v", err)
	// pgx's statement, or the claim's when its first round trip found them
	// missing twice (PgBouncer may run the retry on yet another connection).
	require.Regexp(t, `prepared statement "(stmtcache|dedupactivity)_`, pgErr.Message)
}
