package dedupactivity_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/temporal"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

func TestNewValidatesOptions(t *testing.T) {
	t.Parallel()
	pool := &pgxpool.Pool{} // never used: New fails first
	_, err := dedupactivity.New(nil, dedupactivity.Options{})
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	require.Contains(t, err.Error(), "pool")

	cases := map[string]struct {
		opts  dedupactivity.Options
		field string
	}{
		"TableInjection":  {dedupactivity.Options{Table: `x"; DROP TABLE account; --`}, "Table"},
		"TableUpper":      {dedupactivity.Options{Table: "Markers"}, "Table"},
		"TableTooLong":    {dedupactivity.Options{Table: strings.Repeat("t", 41)}, "Table"},
		"SchemaInjection": {dedupactivity.Options{Schema: "public; DROP SCHEMA public"}, "Schema"},
		"SchemaPgTemp":    {dedupactivity.Options{Schema: "pg_temp"}, "pg_ prefix"},
		"SchemaPgCatalog": {dedupactivity.Options{Schema: "pg_catalog"}, "pg_ prefix"},
		"ClaimWait":       {dedupactivity.Options{ClaimWait: -1}, "ClaimWait"},
		"ClaimWaitHuge":   {dedupactivity.Options{ClaimWait: 720 * time.Hour}, "ClaimWait"},
		"Retention":       {dedupactivity.Options{Retention: 1}, "Retention"},
		"Policy":          {dedupactivity.Options{MismatchPolicy: 42}, "MismatchPolicy"},
		"MaxResultBytes":  {dedupactivity.Options{MaxResultBytes: -1}, "MaxResultBytes"},
		// 200 years ahead: past what a time.Duration holds (292 years), the
		// bounds of the partitions ahead would wrap.
		"PartitionsAheadHuge": {dedupactivity.Options{PartitionInterval: 24 * time.Hour, PartitionsAhead: 200 * 366}, "PartitionsAhead"},
		"PartitionsAheadWrap": {dedupactivity.Options{PartitionInterval: 24 * time.Hour, PartitionsAhead: 200_000}, "PartitionsAhead"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := dedupactivity.New(pool, c.opts)
			require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
			require.Contains(t, err.Error(), c.field)
		})
	}
}

func TestBadCalls(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})

	t.Run("NotAnActivityContext", func(t *testing.T) {
		fn := dedupactivity.Wrap(b.d, b.post)
		_, err := fn(context.Background(), Transfer{Account: "a", Amount: 1})
		require.ErrorIs(t, err, dedupactivity.ErrNotActivity)
		ae := appErr(t, err)
		require.Equal(t, dedupactivity.ErrTypeInvalidUsage, ae.Type())
		require.True(t, ae.NonRetryable())
	})
	t.Run("ValuesTheConverterCannotEncode", func(t *testing.T) {
		// Only business-keyed inputs are encoded (fingerprinted).
		chanIn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in chan int) (int, error) { return 0, nil },
			dedupactivity.WithBusinessKey(func(chan int) (string, error) { return "k", nil }))
		chanOut := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (chan int, error) {
			_, err := b.post(ctx, tx, in)
			return make(chan int), err
		})
		// The driver hands the wrapped functions values Temporal itself
		// could not have delivered.
		driver := func(ctx context.Context, which string) (string, error) {
			var err error
			if which == "in" {
				_, err = chanIn(ctx, make(chan int))
			} else {
				_, err = chanOut(ctx, Transfer{Account: "a", Amount: 1})
			}
			return "", err
		}
		for _, which := range []string{"in", "out"} {
			_, err := deliver(t, "Driver", driver, which)
			require.ErrorIs(t, err, dedupactivity.ErrEncoding, which)
			ae := appErr(t, err)
			require.Equal(t, dedupactivity.ErrTypeEncoding, ae.Type())
			require.True(t, ae.NonRetryable())
		}
	})
	// What Temporal records for an error of the key function: the SDK
	// converts the error an activity returns by its top-level type.
	t.Run("BusinessKeyFunctionFails", func(t *testing.T) {
		cases := map[string]struct {
			err          error
			message      string
			nonRetryable bool
		}{
			"ApplicationError": {temporal.NewNonRetryableApplicationError("order not found", "BadOrder", nil), "order not found", true},
			"OtherError":       {errors.New("lookup failed"), "dedupactivity: business key: lookup failed", false},
		}
		for name, c := range cases {
			fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(Transfer) (string, error) { return "", c.err }))
			_, err := deliver(t, "Keyed", fn, Transfer{Account: "a", Amount: 1})
			f := temporal.GetDefaultFailureConverter().ErrorToFailure(err)
			require.Equal(t, c.message, f.GetMessage(), name)
			require.NotNil(t, f.GetApplicationFailureInfo(), name)
			require.Equal(t, c.nonRetryable, f.GetApplicationFailureInfo().GetNonRetryable(), name)
			if name == "ApplicationError" {
				require.Equal(t, "BadOrder", f.GetApplicationFailureInfo().GetType())
			}
		}
	})
	// A null input for an interface-typed In reaches the key function as
	// In's zero value, not as a panic.
	t.Run("BusinessKeyOfNilInput", func(t *testing.T) {
		fn := dedupactivity.Wrap(b.d, func(context.Context, pgx.Tx, any) (Posting, error) { return Posting{}, nil },
			dedupactivity.WithBusinessKey(func(in any) (string, error) {
				if in == nil {
					return "", errors.New("no input, no key")
				}
				return "k", nil
			}))
		_, err := deliver[any, Posting](t, "AnyIn", fn, nil)
		require.ErrorContains(t, err, "no input, no key")
	})
	t.Run("HugeBusinessKey", func(t *testing.T) {
		fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(Transfer) (string, error) {
			return strings.Repeat("k", 1<<20), nil
		}))
		_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
		require.ErrorIs(t, err, dedupactivity.ErrIdentityTooLarge)
	})
	t.Run("BusinessKeyWithNULAndInvalidUTF8", func(t *testing.T) {
		fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) {
			return "k\x00\xff" + in.Account, nil
		}))
		_, err := deliver(t, "Odd", fn, Transfer{Account: "b", Amount: 1})
		require.NoError(t, err)
		_, err = deliver(t, "Odd", fn, Transfer{Account: "b", Amount: 1})
		require.NoError(t, err)
		require.Equal(t, int64(1), b.count(t, `SELECT count(*) FROM ledger WHERE account = 'b'`))
	})
	require.Zero(t, b.count(t, `SELECT count(*) FROM ledger WHERE account = 'a'`), "no bad call wrote anything")
}

// TestMisuseFailsAtWrapTime: what can never work is refused when the
// activity is wrapped or registered (a panic, as the SDK's own registration
// does), not on every attempt; Do refuses it with an error.
func TestMisuseFailsAtWrapTime(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	require.Panics(t, func() { dedupactivity.Register(nil, b.d, "", b.post) })
	require.Panics(t, func() { dedupactivity.Register[Transfer, Posting](nil, nil, "Post", b.post) })
	cases := map[string]func(){
		"NilDeduper":  func() { dedupactivity.Wrap[Transfer, Posting](nil, b.post) },
		"ZeroDeduper": func() { dedupactivity.Wrap[Transfer, Posting](&dedupactivity.Deduper{}, b.post) },
		"NilEffect":   func() { dedupactivity.Wrap[Transfer, Posting](b.d, nil) },
		"NilKey": func() {
			dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey[Transfer](nil))
		},
		"ShortRetention": func() { dedupactivity.Wrap(b.d, b.post, dedupactivity.WithRetention(time.Second)) },
	}
	for name, wrap := range cases {
		t.Run(name, func(t *testing.T) {
			require.PanicsWithValue(t, wrapPanic(t, wrap), wrap)
		})
	}

	// So is pruning with a Deduper New did not make, or without a client.
	const pruner = "dedupactivity: RegisterPruner needs a Deduper made by New"
	require.PanicsWithValue(t, pruner, func() { dedupactivity.RegisterPruner(nil, nil) })
	require.PanicsWithValue(t, pruner, func() { dedupactivity.RegisterPruner(nil, &dedupactivity.Deduper{}) })
	ctx := context.Background()
	for _, d := range []*dedupactivity.Deduper{nil, {}} {
		err := dedupactivity.EnsurePruneSchedule(ctx, nil, d, "prune", "q", time.Hour)
		require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
		require.ErrorContains(t, err, "needs a Deduper made by New")
	}
	err := dedupactivity.EnsurePruneSchedule(ctx, nil, b.d, "prune", "q", time.Hour)
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	require.ErrorContains(t, err, "the Temporal client is nil")
	_, err = dedupactivity.ClaimTx[Posting](ctx, &dedupactivity.Deduper{}, nil, dedupactivity.Identity{}, nil)
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	require.ErrorContains(t, err, "not made by New")

	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "k"}
	_, _, err = dedupactivity.Do(ctx, b.d, id, Transfer{Account: "a", Amount: 1}, b.post,
		dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return in.Account, nil }))
	require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions)
	require.ErrorContains(t, err, "WithBusinessKey")

	// A hand-built identity that lacks a field of its kind is named as such.
	for _, id := range []dedupactivity.Identity{
		{Kind: dedupactivity.KindActivity, Namespace: "ns", WorkflowID: "wf"},
		{Kind: dedupactivity.KindStandalone, ActivityID: "1"},
		{Kind: 42},
	} {
		_, _, err := dedupactivity.Do(ctx, b.d, id, Transfer{Account: "a", Amount: 1}, b.post)
		require.ErrorIs(t, err, dedupactivity.ErrInvalidIdentity, "%+v", id)
		require.NotErrorIs(t, err, dedupactivity.ErrNotActivity)
	}
	require.Zero(t, b.ledgerRows(t))
}

// wrapPanic returns the value wrap panics with, which must name
// ErrInvalidOptions.
func wrapPanic(t *testing.T, wrap func()) (v any) {
	t.Helper()
	defer func() {
		v = recover()
		require.Contains(t, fmt.Sprint(v), dedupactivity.ErrInvalidOptions.Error())
	}()
	wrap()
	return nil
}

func TestNotMigrated(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	d, err := dedupactivity.New(s.Pool, dedupactivity.Options{})
	require.NoError(t, err)
	fn := dedupactivity.Wrap(d, func(ctx context.Context, tx pgx.Tx, in Transfer) (int, error) { return 1, nil })
	_, err = deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.ErrorIs(t, err, dedupactivity.ErrNotMigrated)
	var ae *temporal.ApplicationError
	require.False(t, errors.As(err, &ae) && ae.NonRetryable(), "retryable: Temporal tries again once Migrate has run")
}

func TestReadOnlyDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	_, err := b.pool.Exec(context.Background(), `SELECT 1`)
	require.NoError(t, err)
	cfg := b.pool.Config().Copy()
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	ro, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer ro.Close()
	d, err := dedupactivity.New(ro, dedupactivity.Options{})
	require.NoError(t, err)
	fn := dedupactivity.Wrap(d, b.post)
	_, err = deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.ErrorIs(t, err, dedupactivity.ErrReadOnly)
	require.Zero(t, b.markers(t))
}

// scheduleRecorder is a Temporal client whose Schedule client records the
// Schedules it is asked to create (and fails every other call).
type scheduleRecorder struct {
	client.Client
	sc *createdSchedules
}

func (c scheduleRecorder) ScheduleClient() client.ScheduleClient { return c.sc }

type createdSchedules struct {
	client.ScheduleClient
	created []client.ScheduleOptions
}

func (s *createdSchedules) Create(_ context.Context, o client.ScheduleOptions) (client.ScheduleHandle, error) {
	s.created = append(s.created, o)
	return nil, nil
}

// TestPruneScheduleIntervalChecked: EnsurePruneSchedule refuses, before it
// calls Temporal, an interval under a minute and, in the partitioned
// layout, one that leaves no second run within the partitions made ahead,
// up to the longest time.Duration.
func TestPruneScheduleIntervalChecked(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	for _, c := range []struct {
		opts     dedupactivity.Options
		interval time.Duration
		ok       bool
	}{
		{dedupactivity.Options{}, 59 * time.Second, false},
		{dedupactivity.Options{}, time.Minute, true}, // "at least 1m": the bound itself is accepted
		{dedupactivity.Options{}, 24 * time.Hour, true},
		{dedupactivity.Options{PartitionInterval: time.Hour}, 90 * time.Minute, true}, // PartitionsAhead 3: 3h ahead
		{dedupactivity.Options{PartitionInterval: time.Hour}, 91 * time.Minute, false},
		{dedupactivity.Options{PartitionInterval: time.Hour, PartitionsAhead: 48}, 24 * time.Hour, true},
		{dedupactivity.Options{PartitionInterval: time.Hour, PartitionsAhead: 1}, time.Hour, false},
		// Past 146 years, doubling the interval wrapped to a negative
		// time.Duration, taken as within the partitions ahead.
		{dedupactivity.Options{PartitionInterval: time.Hour}, 150 * 365 * 24 * time.Hour, false},
		{dedupactivity.Options{PartitionInterval: time.Hour}, math.MaxInt64, false},
	} {
		c.opts.Table = "unmigrated"
		d, err := dedupactivity.New(b.pool, c.opts)
		require.NoError(t, err)
		rec := scheduleRecorder{sc: &createdSchedules{}}
		err = dedupactivity.EnsurePruneSchedule(context.Background(), rec, d, "prune", "q", c.interval)
		if c.ok {
			require.NoError(t, err, "%+v", c)
			require.Len(t, rec.sc.created, 1, "%+v", c)
			continue
		}
		require.ErrorIs(t, err, dedupactivity.ErrInvalidOptions, "%+v", c)
		require.Empty(t, rec.sc.created, "%+v", c)
	}
}

// refusingConverter is the default converter, except that it refuses to
// encode a Posting with an ApplicationError, as a codec whose key service
// is down might.
type refusingConverter struct {
	converter.DataConverter
	refusal error
}

func (c refusingConverter) ToPayload(v any) (*commonpb.Payload, error) {
	if _, ok := v.(Posting); ok {
		return nil, c.refusal
	}
	return c.DataConverter.ToPayload(v)
}

// TestConverterRefusalAtTheEdge: an ApplicationError the DataConverter
// returns inside the library's ErrEncoding still reaches Temporal as
// DedupEncoding, with the converter's own retryability. The SDK converts
// an error by its top-level type, so ErrEncoding's wrapping would otherwise
// make it a retryable failure of type "wrapError", whatever either said.
func TestConverterRefusalAtTheEdge(t *testing.T) {
	t.Parallel()
	for name, nonRetryable := range map[string]bool{"Retryable": false, "NonRetryable": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			refusal := temporal.NewApplicationErrorWithOptions("key service unavailable", "KMS", temporal.ApplicationErrorOptions{NonRetryable: nonRetryable})
			b := setup(t, dedupactivity.Options{DataConverter: refusingConverter{converter.GetDefaultDataConverter(), refusal}})
			fn := dedupactivity.Wrap(b.d, b.post)
			_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
			require.ErrorIs(t, err, dedupactivity.ErrEncoding)
			f := temporal.GetDefaultFailureConverter().ErrorToFailure(err)
			require.NotNil(t, f.GetApplicationFailureInfo())
			require.Equal(t, dedupactivity.ErrTypeEncoding, f.GetApplicationFailureInfo().GetType())
			require.Equal(t, nonRetryable, f.GetApplicationFailureInfo().GetNonRetryable())
			require.Contains(t, f.GetMessage(), refusal.Error())
			var n int
			require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM ledger`).Scan(&n))
			require.Zero(t, n, "the effect is rolled back")
		})
	}
}

// unreadableConverter is the default converter, except that it cannot
// decode a Posting once gone is set (a codec whose key is gone since, a
// type changed since).
type unreadableConverter struct {
	converter.DataConverter
	gone *atomic.Bool
}

func (c unreadableConverter) FromPayload(p *commonpb.Payload, v any) error {
	if _, ok := v.(*Posting); ok && c.gone.Load() {
		return errors.New("cannot decrypt: key unavailable")
	}
	return c.DataConverter.FromPayload(p, v)
}

// TestStoredResultUnreadableIsRetryable: a duplicate whose stored result
// the converter cannot decode fails retryable, as the SDK fails an input
// it cannot decode. The effect is applied: a non-retryable failure would
// tell the workflow it was not (and a workflow that compensates would undo
// an applied effect), where a retry returns the result once the converter
// reads it again.
func TestStoredResultUnreadableIsRetryable(t *testing.T) {
	t.Parallel()
	gone := new(atomic.Bool)
	b := setup(t, dedupactivity.Options{DataConverter: unreadableConverter{converter.GetDefaultDataConverter(), gone}})
	fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return "once", nil }))
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	gone.Store(true)
	_, err = deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.ErrorIs(t, err, dedupactivity.ErrEncoding)
	f := temporal.GetDefaultFailureConverter().ErrorToFailure(err)
	require.Equal(t, dedupactivity.ErrTypeEncoding, f.GetApplicationFailureInfo().GetType())
	require.False(t, f.GetApplicationFailureInfo().GetNonRetryable(), "the effect is applied: retry until the result reads")
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM ledger`).Scan(&n))
	require.Equal(t, 1, n, "applied once")
}
