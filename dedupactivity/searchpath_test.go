package dedupactivity_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

// TestEffectChangingSearchPath: with Options.Schema empty the marker table
// is named without its schema. An effect that points search_path at another
// schema with a marker table of its own (a schema per tenant) must not have
// the marker, or its result, written there, where the next delivery does
// not look: that delivery would apply the event again. The attempt fails
// with ErrSearchPathChanged and commits nothing, whichever path the claim
// took; a path that still finds the same table is fine.
func TestEffectChangingSearchPath(t *testing.T) {
	t.Parallel()
	for _, layout := range []struct {
		name string
		opts dedupactivity.Options
	}{
		{"Default", dedupactivity.Options{}},
		{"Partitioned", dedupactivity.Options{PartitionInterval: time.Hour, Retention: time.Hour}},
	} {
		t.Run(layout.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, layout.opts)
			ctx := context.Background()
			// Another tenant's schema, with a marker table made by the same
			// migrations, and already a marker of another event in it: a
			// result written by ctid would find a row there.
			other := pgtest.NewSchema(t)
			od, err := dedupactivity.New(other.Pool, layout.opts)
			require.NoError(t, err)
			require.NoError(t, od.Migrate(ctx))
			mine, theirs := pgx.Identifier{b.schema.Name}.Sanitize(), pgx.Identifier{other.Name}.Sanitize()
			_, err = b.pool.Exec(ctx, `INSERT INTO `+theirs+`.dedup_marker (id_hash, attempt, expires_at, activity_type, result`+
				map[bool]string{true: `, scheduled_at`}[layout.opts.PartitionInterval > 0]+`)
				VALUES (decode(repeat('ab', 32), 'hex'), 1, now() + interval '1 hour', 'Other', '\x07'`+
				map[bool]string{true: `, now()`}[layout.opts.PartitionInterval > 0]+`)`)
			require.NoError(t, err)
			count := func(table string) int64 { return b.count(t, `SELECT count(*) FROM `+table) }
			// effect switches search_path as the test says, then posts to
			// this schema's ledger by its qualified name.
			effect := func(setPath func(ctx context.Context, tx pgx.Tx) error) dedupactivity.EffectFunc[Transfer, Posting] {
				return func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
					var p Posting
					if err := setPath(ctx, tx); err != nil {
						return p, err
					}
					err := tx.QueryRow(ctx, `INSERT INTO `+mine+`.ledger (account, amount) VALUES ($1, $2) RETURNING id`, in.Account, in.Amount).Scan(&p.EntryID)
					return p, err
				}
			}
			withArgs := func(path string) func(context.Context, pgx.Tx) error {
				return func(ctx context.Context, tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `SELECT set_config('search_path', $1, true)`, path)
					return err
				}
			}
			type pathCase struct {
				name    string
				setPath func(context.Context, pgx.Tx) error
				key     bool // a business key: the claim goes first
			}
			cases := []pathCase{
				// The claim rides with the first statement as a look; the
				// marker would go in at COMMIT.
				{"Riding", withArgs(theirs), false},
				// A call without arguments inserts the marker's key first,
				// under the session's path; the result would go by ctid.
				{"KeyFirst", func(ctx context.Context, tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `SET LOCAL search_path = `+theirs)
					return err
				}, false},
				// The look, then a call without arguments: the key would go
				// to the other table.
				{"LookThenKey", func(ctx context.Context, tx pgx.Tx) error {
					if err := withArgs(theirs)(ctx, tx); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, `SELECT 1`)
					return err
				}, false},
			}
			if layout.opts.PartitionInterval == 0 { // the partitioned layout takes no business keys
				cases = append(cases, pathCase{"BusinessKey", withArgs(theirs), true})
			}
			for i, c := range cases {
				t.Run(c.name, func(t *testing.T) { // in turn: they share the tables
					_, err := b.pool.Exec(ctx, `DELETE FROM `+mine+`.dedup_marker`)
					require.NoError(t, err)
					ledger := count(mine + ".ledger")
					var opts []dedupactivity.WrapOption
					if c.key {
						opts = append(opts, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return in.Account, nil }))
					}
					name := fmt.Sprintf("Post%d", i)
					_, err = deliver(t, name, dedupactivity.Wrap(b.d, effect(c.setPath), opts...), Transfer{Account: "a", Amount: 1})
					require.ErrorIs(t, err, dedupactivity.ErrSearchPathChanged)
					var appErr *temporal.ApplicationError
					require.True(t, errors.As(err, &appErr))
					require.True(t, appErr.NonRetryable())
					require.Equal(t, dedupactivity.ErrTypeInvalidUsage, appErr.Type())
					require.Equal(t, ledger, count(mine+".ledger"), "nothing committed")
					require.Equal(t, int64(0), count(mine+".dedup_marker"))
					require.Equal(t, int64(1), count(theirs+".dedup_marker"))
					var result []byte
					require.NoError(t, b.pool.QueryRow(ctx, `SELECT result FROM `+theirs+`.dedup_marker`).Scan(&result))
					require.Equal(t, []byte{7}, result, "the other table's marker is untouched")

					// The next delivery, under the session's path, applies
					// the event once.
					noChange := func(context.Context, pgx.Tx) error { return nil }
					_, err = deliver(t, name, dedupactivity.Wrap(b.d, effect(noChange), opts...), Transfer{Account: "a", Amount: 1})
					require.NoError(t, err)
					require.Equal(t, ledger+1, count(mine+".ledger"))
				})
			}

			if layout.opts.PartitionInterval == 0 {
				// In the caller's own transaction: Complete checks the table.
				t.Run("ClaimTx", func(t *testing.T) {
					_, err := b.pool.Exec(ctx, `DELETE FROM `+mine+`.dedup_marker`)
					require.NoError(t, err)
					id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "claimtx"}
					tx, err := b.pool.Begin(ctx)
					require.NoError(t, err)
					defer func() { _ = tx.Rollback(ctx) }()
					c, err := dedupactivity.ClaimTx[int](ctx, b.d, tx, id, 1)
					require.NoError(t, err)
					require.Equal(t, dedupactivity.OutcomeClaimed, c.Outcome())
					require.NoError(t, withArgs(theirs)(ctx, tx))
					require.ErrorIs(t, c.Complete(ctx, 1), dedupactivity.ErrSearchPathChanged)
					require.NoError(t, tx.Rollback(ctx))
					var result []byte
					require.NoError(t, b.pool.QueryRow(ctx, `SELECT result FROM `+theirs+`.dedup_marker`).Scan(&result))
					require.Equal(t, []byte{7}, result, "the other table's marker is untouched")
				})
			}

			// A path that finds no marker table fails the marker's statement:
			// ErrNotMigrated, and nothing commits.
			t.Run("NoTable", func(t *testing.T) {
				_, err := b.pool.Exec(ctx, `DELETE FROM `+mine+`.dedup_marker`)
				require.NoError(t, err)
				ledger := count(mine + ".ledger")
				_, err = deliver(t, "NoTable", dedupactivity.Wrap(b.d, effect(withArgs("pg_catalog"))), Transfer{Account: "a", Amount: 1})
				require.ErrorIs(t, err, dedupactivity.ErrNotMigrated)
				require.Equal(t, ledger, count(mine+".ledger"))
				require.Equal(t, int64(0), count(mine+".dedup_marker"))
			})

			// A path that still finds this schema's table first is no change.
			_, err = b.pool.Exec(ctx, `DELETE FROM `+mine+`.dedup_marker`)
			require.NoError(t, err)
			ledger := count(mine + ".ledger")
			_, err = deliver(t, "SamePath", dedupactivity.Wrap(b.d, effect(withArgs(mine+", "+theirs))), Transfer{Account: "a", Amount: 1})
			require.NoError(t, err)
			require.Equal(t, ledger+1, count(mine+".ledger"))
			require.Equal(t, int64(1), count(mine+".dedup_marker"))

			// Under every exec mode (the simple protocol claims first).
			t.Run("ExecModes", func(t *testing.T) {
				for mode, em := range execModes {
					_, err := b.pool.Exec(ctx, `DELETE FROM `+mine+`.dedup_marker`)
					require.NoError(t, err)
					ledger := count(mine + ".ledger")
					cfg, err := pgxpool.ParseConfig(b.schema.URL)
					require.NoError(t, err)
					cfg.ConnConfig.DefaultQueryExecMode = em
					pool, err := pgxpool.NewWithConfig(ctx, cfg)
					require.NoError(t, err)
					d, err := dedupactivity.New(pool, layout.opts)
					require.NoError(t, err)
					_, err = deliver(t, "Modes", dedupactivity.Wrap(d, effect(withArgs(theirs))), Transfer{Account: "a", Amount: 1})
					require.ErrorIs(t, err, dedupactivity.ErrSearchPathChanged, mode)
					require.Equal(t, ledger, count(mine+".ledger"), mode)
					_, err = deliver(t, "Modes", dedupactivity.Wrap(d, effect(withArgs(mine))), Transfer{Account: "a", Amount: 1})
					require.NoError(t, err, mode)
					require.Equal(t, ledger+1, count(mine+".ledger"), mode)
					pool.Close()
				}
			})

			// The look, then a call without arguments whose key the other
			// table holds already: no duplicate of this table's event.
			t.Run("LookThenKeyFound", func(t *testing.T) {
				_, err := b.pool.Exec(ctx, `INSERT INTO `+theirs+`.dedup_marker SELECT * FROM `+mine+`.dedup_marker`)
				require.NoError(t, err)
				_, err = b.pool.Exec(ctx, `DELETE FROM `+mine+`.dedup_marker`)
				require.NoError(t, err)
				ledger := count(mine + ".ledger")
				_, err = deliver(t, "Found", dedupactivity.Wrap(b.d, effect(func(ctx context.Context, tx pgx.Tx) error {
					if err := withArgs(theirs)(ctx, tx); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, `SELECT 1`)
					return err
				})), Transfer{Account: "a", Amount: 1})
				require.ErrorIs(t, err, dedupactivity.ErrSearchPathChanged)
				require.Equal(t, ledger, count(mine+".ledger"))
				require.Equal(t, int64(0), count(mine+".dedup_marker"))
			})
		})
	}
}
