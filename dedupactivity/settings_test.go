package dedupactivity_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

var execModes = map[string]pgx.QueryExecMode{
	"CacheStatement": pgx.QueryExecModeCacheStatement,
	"CacheDescribe":  pgx.QueryExecModeCacheDescribe,
	"DescribeExec":   pgx.QueryExecModeDescribeExec,
	"Exec":           pgx.QueryExecModeExec,
	"SimpleProtocol": pgx.QueryExecModeSimpleProtocol,
}

// claimDupMismatch runs, through d, a first delivery, a duplicate and a
// mismatching delivery of one business-keyed event whose effect writes to
// schema's tables by qualified name, and checks what each returned and what
// the database holds.
func claimDupMismatch(t *testing.T, d *dedupactivity.Deduper, b *testBundle, key string) {
	t.Helper()
	ctx := context.Background()
	s := pgx.Identifier{b.schema.Name}.Sanitize()
	post := func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		var p Posting
		if err := tx.QueryRow(ctx, `INSERT INTO `+s+`.ledger (account, amount) VALUES ($1, $2) RETURNING id`, in.Account, in.Amount).Scan(&p.EntryID); err != nil {
			return p, err
		}
		err := tx.QueryRow(ctx, `UPDATE `+s+`.account SET balance = balance + $2 WHERE id = $1 RETURNING balance`, in.Account, in.Amount).Scan(&p.Balance)
		return p, err
	}
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: key}
	// An account of its own: subtests run in parallel, and one of them sets
	// a 1ms lock_timeout that the effect keeps.
	_, err := b.pool.Exec(ctx, `INSERT INTO account (id) VALUES ($1)`, key)
	require.NoError(t, err)
	in := Transfer{Account: key, Amount: 3}
	first, outcome, err := dedupactivity.Do(ctx, d, id, in, post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	dup, outcome, err := dedupactivity.Do(ctx, d, id, in, post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, first, dup)
	_, outcome, err = dedupactivity.Do(ctx, d, id, Transfer{Account: key, Amount: 4}, post)
	require.ErrorIs(t, err, dedupactivity.ErrPayloadMismatch)
	require.Equal(t, dedupactivity.OutcomePayloadMismatch, outcome)
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM ledger WHERE amount = 3 AND id = $1`, first.EntryID))
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM dedup_marker WHERE id_hash = $1`, hashOf(id)))

	// A run-scoped identity: the claim rides with the first statement.
	id = runScoped(key)
	first, outcome, err = dedupactivity.Do(ctx, d, id, in, post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	dup, outcome, err = dedupactivity.Do(ctx, d, id, in, post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, first, dup)
	require.Equal(t, int64(2), b.count(t, `SELECT count(*) FROM ledger WHERE account = $1`, key))
	require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM dedup_marker WHERE id_hash = $1`, hashOf(id)))
}

// TestAnySessionSettingAndExecMode: claims, duplicates and mismatches work
// under server settings that change how values are written and read, and
// with every pgx QueryExecMode.
func TestAnySessionSettingAndExecMode(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	settings := map[string]map[string]string{
		"ByteaEscape":              {"bytea_output": "escape"},
		"NonStandardStrings":       {"standard_conforming_strings": "off"},
		"Serializable":             {"default_transaction_isolation": "serializable"},
		"SearchPathWithoutTable":   {"search_path": "pg_catalog"},
		"OddTimeAndNumbers":        {"TimeZone": "Pacific/Chatham", "DateStyle": "SQL, DMY", "IntervalStyle": "iso_8601", "extra_float_digits": "-15"},
		"SessionLockTimeout":       {"lock_timeout": "1ms"},
		"RepeatableReadAndEscape":  {"default_transaction_isolation": "repeatable read", "bytea_output": "escape"},
		"SerializableDeferrable":   {"default_transaction_deferrable": "on", "default_transaction_isolation": "serializable"},
		"ApplicationNameAndSearch": {"application_name": "dedup-test", "search_path": `"$user"`},
		// The claim's statements are prepared once per connection: run
		// their generic plans from the first execution.
		"GenericPlansAndLockTimeout": {"plan_cache_mode": "force_generic_plan", "lock_timeout": "1ms"},
	}
	i := 0
	for name, params := range settings {
		for mode, m := range execModes {
			i++
			key := fmt.Sprintf("k%d", i)
			t.Run(name+"/"+mode, func(t *testing.T) {
				t.Parallel()
				cfg, err := pgxpool.ParseConfig(b.schema.URL)
				require.NoError(t, err)
				cfg.MaxConns = 2
				cfg.ConnConfig.DefaultQueryExecMode = m
				for k, v := range params {
					cfg.ConnConfig.RuntimeParams[k] = v
				}
				pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
				require.NoError(t, err)
				defer pool.Close()
				// The table is named with its schema, whatever the search_path.
				d, err := dedupactivity.New(pool, dedupactivity.Options{Schema: b.schema.Name})
				require.NoError(t, err)
				if params["standard_conforming_strings"] == "off" && m == pgx.QueryExecModeSimpleProtocol {
					// pgx refuses every simple-protocol query here, the
					// effect's own too; nothing is written.
					_, _, err := dedupactivity.Do(context.Background(), d, dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: key}, Transfer{Account: "a", Amount: 3}, b.post)
					require.ErrorContains(t, err, "standard_conforming_strings=on")
					return
				}
				claimDupMismatch(t, d, b, key)
				if lt := params["lock_timeout"]; lt != "" {
					// The effect runs under the session's own lock_timeout.
					_, _, err := dedupactivity.Do(context.Background(), d,
						dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "LockTimeout", Key: key}, 0,
						func(ctx context.Context, tx pgx.Tx, _ int) (string, error) {
							var got string
							err := tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got)
							if err == nil && got != lt {
								err = fmt.Errorf("effect's lock_timeout %q, session's %q", got, lt)
							}
							return got, err
						})
					require.NoError(t, err)
				}
			})
		}
	}
}

// TestStatementTimeoutShorterThanClaimWait: a session statement_timeout
// below the claim wait ends the wait as a claim timeout, not a bare 57014.
func TestStatementTimeoutShorterThanClaimWait(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	id, in, releaseHeld := heldEvent(t, b)

	cfg, err := pgxpool.ParseConfig(b.schema.URL)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["statement_timeout"] = "200ms"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()
	d, err := dedupactivity.New(pool, dedupactivity.Options{ClaimWait: 10 * time.Second})
	require.NoError(t, err)
	began := time.Now()
	_, outcome, err := dedupactivity.Do(context.Background(), d, id, in, b.post)
	require.ErrorIs(t, err, dedupactivity.ErrClaimTimeout)
	require.ErrorContains(t, err, "statement_timeout")
	require.Equal(t, dedupactivity.OutcomeClaimTimeout, outcome)
	require.Less(t, time.Since(began), 5*time.Second)
	releaseHeld()
	require.Equal(t, int64(1), b.ledgerRows(t))
}

// TestConnectionDiedWhileIdle: a pooled connection whose backend died while
// it sat idle does not fail the attempt: the claim's first round trip never
// commits, so it is sent again on a new connection, also when the claim
// rides with the effect's first statement.
func TestConnectionDiedWhileIdle(t *testing.T) {
	t.Parallel()
	for name, id := range map[string]dedupactivity.Identity{
		"ClaimFirst": {Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "idle"},
		"ClaimRides": {Kind: dedupactivity.KindActivity, Namespace: "default", WorkflowID: "w", RunID: "r", ActivityID: "1"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			ctx := context.Background()
			cfg, err := pgxpool.ParseConfig(b.schema.URL)
			require.NoError(t, err)
			cfg.MaxConns = 1
			cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false } // no liveness check on acquire
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			defer pool.Close()
			d, err := dedupactivity.New(pool, dedupactivity.Options{})
			require.NoError(t, err)

			var pid uint32
			require.NoError(t, pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
			_, err = b.pool.Exec(ctx, `SELECT pg_terminate_backend($1, 5000)`, pid)
			require.NoError(t, err)

			_, outcome, err := dedupactivity.Do(ctx, d, id, Transfer{Account: "a", Amount: 1}, b.post)
			require.NoError(t, err)
			require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
			require.Equal(t, int64(1), b.ledgerRows(t))
			var now uint32
			require.NoError(t, pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&now))
			require.NotEqual(t, pid, now, "the dead connection was replaced")
		})
	}
}
