package dedupactivity_test

// Telemetry of the paths an adversarial review of the observability found
// unrecorded or misrecorded: ClaimTx's refusals and Complete's failures, an
// effect's panic and the zero series under MismatchReturnStored
// (TestClaimWaitCancelled checks a cancelled claim wait's error.type).

import (
	"context"
	"errors"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/converter"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// TestClaimTxTelemetry: ClaimTx's attempts are traced and counted as the
// wrapper's are, failures with their error.type.
func TestClaimTxTelemetry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	in := Transfer{Account: "a", Amount: 1}
	idOf := func(key string) dedupactivity.Identity {
		return dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "ns", ActivityType: "Post", Key: key}
	}

	// The refusal of an event claimed twice in one transaction was traced
	// as a success (no status, no error.type): ClaimTx returned a new error
	// value, not the one its deferred telemetry read.
	t.Run("ClaimedTwiceInOneTransaction", func(t *testing.T) {
		t.Parallel()
		b := setupTelemetry(t, dedupactivity.Options{})
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = dedupactivity.ClaimTx[Posting](ctx, b.d, tx, idOf("twice"), in)
		require.NoError(t, err)
		_, err = dedupactivity.ClaimTx[Posting](ctx, b.d, tx, idOf("twice"), in)
		require.ErrorContains(t, err, "already claimed in this transaction")

		ended := b.spans.Ended()
		require.Len(t, ended, 2)
		require.Equal(t, codes.Error, ended[1].Status().Code)
		require.Equal(t, "_OTHER", attr(ended[1], attribute.Key("error.type")).AsString())
		require.Equal(t, map[string]int64{"claimed/": 1, "error/_OTHER": 1}, outsideAttempts(t, b.reader))
	})

	// A Complete that fails used to be counted nowhere: the attempt showed
	// as claimed alone.
	t.Run("CompleteThatFails", func(t *testing.T) {
		t.Parallel()
		b := setupTelemetry(t, dedupactivity.Options{MaxResultBytes: 16})
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		c, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, idOf("too-large"), in)
		require.NoError(t, err)
		require.ErrorIs(t, c.Complete(ctx, Posting{EntryID: 1 << 60, Balance: 1 << 60}), dedupactivity.ErrResultTooLarge)
		require.Equal(t, map[string]int64{"claimed/": 1, "error/" + dedupactivity.ErrTypeResultTooLarge: 1}, outsideAttempts(t, b.reader))
		ended := b.spans.Ended()
		require.Len(t, ended, 2)
		require.Equal(t, codes.Error, ended[1].Status().Code)
		require.Equal(t, dedupactivity.ErrTypeResultTooLarge, attr(ended[1], attribute.Key("error.type")).AsString())
	})

	// The claim is counted when it is made, in the caller's transaction
	// (documented on OutcomeClaimed): a caller that rolls back and claims
	// again counts it twice, while the effect is applied once.
	t.Run("RolledBackAndClaimedAgain", func(t *testing.T) {
		t.Parallel()
		b := setupTelemetry(t, dedupactivity.Options{})
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		c, err := dedupactivity.ClaimTx[Posting](ctx, b.d, tx, idOf("rolled-back"), in)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, c.Outcome())
		require.NoError(t, tx.Rollback(ctx))
		require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
			return b.claimAndPost(ctx, tx, idOf("rolled-back"), in)
		}))
		require.Equal(t, int64(1), b.ledgerRows(t))
		require.Equal(t, map[string]int64{"claimed/": 2}, outsideAttempts(t, b.reader))
	})
}

// TestPanicRecordsItsDurations: an effect that panics records its claim
// and effect durations, as one that returns an error does; it recorded a
// claim duration of 0 and no effect duration (the claim's record was lost
// with the panic).
func TestPanicRecordsItsDurations(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{})
	fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
		if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.1)`); err != nil {
			return Posting{}, err
		}
		if in.Amount == 1 {
			panic("effect bug")
		}
		return Posting{}, errors.New("effect failed")
	}, dedupactivity.WithBusinessKey(func(Transfer) (string, error) { return "k", nil }))
	for _, amount := range []int64{1, 2} { // a panic, then an error
		_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: amount})
		require.Error(t, err)
	}
	require.Zero(t, b.ledgerRows(t))
	ended := b.spans.Ended()
	require.Len(t, ended, 2)
	for i, s := range ended {
		require.Positive(t, attr(s, dedupactivity.ClaimWaitKey).AsFloat64(), "span %d", i)
		require.Equal(t, codes.Error, s.Status().Code)
	}
	counts, sums := histograms(t, b)
	require.Equal(t, uint64(2), counts[dedupactivity.MetricEffectDuration]["effect_error"], "both effects ran")
	require.GreaterOrEqual(t, sums[dedupactivity.MetricEffectDuration]["effect_error"], 0.2)
	require.Equal(t, uint64(2), counts[dedupactivity.MetricClaimDuration]["effect_error"])
	require.Positive(t, sums[dedupactivity.MetricClaimDuration]["effect_error"])

	// Through Do, the caller recovers the effect's own value, and the
	// attempt is counted once more.
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "do"}
	require.PanicsWithValue(t, "effect bug", func() {
		_, _, _ = dedupactivity.Do(context.Background(), b.d, id, Transfer{Account: "a", Amount: 1},
			func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) { panic("effect bug") })
	})
	counts, _ = histograms(t, b)
	require.Equal(t, uint64(3), counts[dedupactivity.MetricEffectDuration]["effect_error"])
}

// TestEffectGoexitIsTraced: an effect that ends its goroutine instead of
// returning (runtime.Goexit, as t.FailNow in an effect does) is an
// effect_error with its durations and an Error span, and its transaction
// is rolled back. recover does not see a Goexit: the attempt was traced as
// an error with no error.type and its span left unset.
func TestEffectGoexitIsTraced(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{})
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "exit"}
	in := Transfer{Account: "a", Amount: 1}
	done := make(chan bool)
	go func() {
		returned := false
		defer func() { done <- returned }()
		_, _, _ = dedupactivity.Do(context.Background(), b.d, id, in, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
			if _, err := b.post(ctx, tx, in); err != nil {
				return Posting{}, err
			}
			if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.05)`); err != nil {
				return Posting{}, err
			}
			runtime.Goexit()
			return Posting{}, nil
		})
		returned = true
	}()
	require.False(t, <-done, "Do returned")
	require.Zero(t, b.ledgerRows(t), "rolled back")
	require.Zero(t, b.markers(t))

	ended := b.spans.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, codes.Error, ended[0].Status().Code)
	require.Equal(t, string(dedupactivity.OutcomeEffectError), attr(ended[0], dedupactivity.OutcomeKey).AsString())
	require.Positive(t, attr(ended[0], dedupactivity.ClaimWaitKey).AsFloat64())
	require.Equal(t, int64(1), allAttemptSeries(t, b.reader)["Post/effect_error/_OTHER"])
	counts, sums := histograms(t, b)
	require.Equal(t, uint64(1), counts[dedupactivity.MetricEffectDuration]["effect_error"])
	require.GreaterOrEqual(t, sums[dedupactivity.MetricEffectDuration]["effect_error"], 0.05)
	require.Equal(t, uint64(1), counts[dedupactivity.MetricClaimDuration]["effect_error"])

	// The connection went back to the pool, the event unclaimed.
	_, o, err := dedupactivity.Do(context.Background(), b.d, id, in, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, o)
	require.Equal(t, int64(1), b.ledgerRows(t))
}

// TestLibraryPanicIsNotTheEffects: a panic outside the effect (here a hook
// between the claim and the effect) reaches the caller unchanged and is
// counted as an error with no durations, not as the effect's failure.
func TestLibraryPanicIsNotTheEffects(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{})
	dedupactivity.SetAfterClaimHook(b.d, func(context.Context, pgx.Tx) error { panic("library bug") })
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "bug"}
	ran := false
	require.PanicsWithValue(t, "library bug", func() {
		_, _, _ = dedupactivity.Do(context.Background(), b.d, id, Transfer{Account: "a", Amount: 1},
			func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				ran = true
				return b.post(ctx, tx, in)
			})
	})
	require.False(t, ran)
	require.Zero(t, b.ledgerRows(t))
	require.Zero(t, b.markers(t))
	ended := b.spans.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, codes.Error, ended[0].Status().Code)
	require.Equal(t, string(dedupactivity.OutcomeError), attr(ended[0], dedupactivity.OutcomeKey).AsString())
	require.Equal(t, int64(1), allAttemptSeries(t, b.reader)["Post/error/_OTHER"])
	counts, _ := histograms(t, b)
	require.Zero(t, counts[dedupactivity.MetricEffectDuration]["error"]+counts[dedupactivity.MetricEffectDuration]["effect_error"])
	require.Zero(t, counts[dedupactivity.MetricClaimDuration]["error"]+counts[dedupactivity.MetricClaimDuration]["effect_error"])
}

// panickingConverter is the default converter, except that it panics
// encoding a Posting once encode is set, and decoding one once decode is.
type panickingConverter struct {
	converter.DataConverter
	encode, decode atomic.Bool
}

func (c *panickingConverter) ToPayload(v any) (*commonpb.Payload, error) {
	if _, ok := v.(Posting); ok && c.encode.Load() {
		panic("converter bug")
	}
	return c.DataConverter.ToPayload(v)
}

func (c *panickingConverter) FromPayload(p *commonpb.Payload, v any) error {
	if _, ok := v.(*Posting); ok && c.decode.Load() {
		panic("converter bug")
	}
	return c.DataConverter.FromPayload(p, v)
}

// TestConverterPanicIsNotTheEffects: a DataConverter that panics on the
// effect's result fails the attempt as an error, with its durations, not as
// the effect's failure (effect_error), and the effect is rolled back; one
// that panics reading a duplicate's stored result fails it as an error with
// its claim duration.
func TestConverterPanicIsNotTheEffects(t *testing.T) {
	t.Parallel()
	encoding := &panickingConverter{DataConverter: converter.GetDefaultDataConverter()}
	encoding.encode.Store(true)
	b := setupTelemetry(t, dedupactivity.Options{DataConverter: encoding})
	fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(Transfer) (string, error) { return "k", nil }))
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.ErrorContains(t, err, "converter bug")
	require.Zero(t, b.ledgerRows(t))
	require.Zero(t, b.markers(t))
	ended := b.spans.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, string(dedupactivity.OutcomeError), attr(ended[0], dedupactivity.OutcomeKey).AsString())
	require.Equal(t, int64(1), allAttemptSeries(t, b.reader)["Post/error/_OTHER"])
	counts, _ := histograms(t, b)
	require.Equal(t, uint64(1), counts[dedupactivity.MetricEffectDuration]["error"], "the effect ran")
	require.Zero(t, counts[dedupactivity.MetricEffectDuration]["effect_error"])
	require.Equal(t, uint64(1), counts[dedupactivity.MetricClaimDuration]["error"])

	// A duplicate whose stored result the converter panics on.
	decoding := &panickingConverter{DataConverter: converter.GetDefaultDataConverter()}
	plain := setupTelemetry(t, dedupactivity.Options{DataConverter: decoding})
	id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: "stored"}
	in := Transfer{Account: "a", Amount: 1}
	_, _, err = dedupactivity.Do(context.Background(), plain.d, id, in, plain.post)
	require.NoError(t, err)
	decoding.decode.Store(true)
	require.PanicsWithValue(t, "converter bug", func() { _, _, _ = dedupactivity.Do(context.Background(), plain.d, id, in, plain.post) })
	require.Equal(t, int64(1), plain.ledgerRows(t))
	counts, sums := histograms(t, plain)
	require.Equal(t, uint64(1), counts[dedupactivity.MetricClaimDuration]["error"], "the duplicate claimed")
	require.Positive(t, sums[dedupactivity.MetricClaimDuration]["error"])
	require.Zero(t, counts[dedupactivity.MetricEffectDuration]["error"])
	require.Equal(t, int64(1), allAttemptSeries(t, plain.reader)["Post/error/_OTHER"])
}

// TestReturnStoredSeedsTheRejectedMismatch: under MismatchReturnStored a
// run-scoped identity delivered by another activity type is still
// rejected with DedupPayloadMismatch; that series was not made at zero, so
// the first one never showed in increase() and its alert did not fire.
func TestReturnStoredSeedsTheRejectedMismatch(t *testing.T) {
	t.Parallel()
	b := setupTelemetry(t, dedupactivity.Options{MismatchPolicy: dedupactivity.MismatchReturnStored})
	keyed := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(Transfer) (string, error) { return "k", nil }))
	plain := dedupactivity.Wrap(b.d, b.post)
	in := Transfer{Account: "a", Amount: 1}
	_, err := deliver(t, "Other", keyed, in) // makes Other's series
	require.NoError(t, err)
	_, err = deliver(t, "Post", plain, in) // run-scoped: the test environment's IDs
	require.NoError(t, err)
	const rejected = "Other/payload_mismatch/" + dedupactivity.ErrTypePayloadMismatch
	before := allAttemptSeries(t, b.reader) // a scrape
	v, seeded := before[rejected]
	require.True(t, seeded, "made at zero before the first: %v", before)
	require.Zero(t, v)
	require.Contains(t, before, "Other/payload_mismatch/", "the mismatch the policy returns stored is made too")
	_, err = deliver(t, "Other", plain, in) // the same run-scoped IDs, another type
	require.ErrorIs(t, err, dedupactivity.ErrPayloadMismatch)
	require.Equal(t, int64(1), allAttemptSeries(t, b.reader)[rejected])
}
