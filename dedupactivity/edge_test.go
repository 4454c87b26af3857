package dedupactivity_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

// TestEffectErrorWrappingASentinelIsUnchanged: the effect's own error
// reaches Temporal unchanged even when it wraps one of this package's
// sentinels, as the error of a nested Do (or ClaimTx) the effect made on
// another event would: it is not converted into that sentinel's
// ApplicationError, which would make a nested claim timeout or payload
// mismatch the activity's own non-retryable DedupPayloadMismatch.
func TestEffectErrorWrappingASentinelIsUnchanged(t *testing.T) {
	t.Parallel()
	for _, sentinel := range []error{dedupactivity.ErrPayloadMismatch, dedupactivity.ErrClaimTimeout} {
		t.Run(sentinel.Error(), func(t *testing.T) {
			t.Parallel()
			b := setup(t, dedupactivity.Options{})
			effectErr := fmt.Errorf("sub-ledger event: %w", sentinel)
			fn := dedupactivity.Wrap(b.d, func(ctx context.Context, tx pgx.Tx, in Transfer) (Posting, error) {
				if _, err := b.post(ctx, tx, in); err != nil {
					return Posting{}, err
				}
				return Posting{}, effectErr
			})
			_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
			require.Equal(t, effectErr, err, "the effect's error, unchanged")
			require.False(t, errors.As(err, new(*temporal.ApplicationError)), "not converted to an ApplicationError")
			require.Zero(t, b.ledgerRows(t), "rolled back")
			require.Zero(t, b.markers(t))
		})
	}
}

// TestDatabaseErrorsStayPlainAtTheEdge: ErrNotMigrated and ErrReadOnly
// reach Temporal as they are (plain Go errors, retryable), not as
// ApplicationErrors of their error.type (DedupNotMigrated, DedupReadOnly),
// as the README's table of errors at the activity edge says: they are the
// database's state, which a migration or a fail-over fixes. The read-only
// attempt's span carries error.type DedupReadOnly.
func TestDatabaseErrorsStayPlainAtTheEdge(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	unmigrated, err := dedupactivity.New(s.Pool, dedupactivity.Options{})
	require.NoError(t, err)

	b := setup(t, dedupactivity.Options{})
	cfg := b.pool.Config().Copy()
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	ro, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(ro.Close)
	spans := tracetest.NewSpanRecorder()
	readOnly, err := dedupactivity.New(ro, dedupactivity.Options{TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))})
	require.NoError(t, err)

	for sentinel, d := range map[error]*dedupactivity.Deduper{dedupactivity.ErrNotMigrated: unmigrated, dedupactivity.ErrReadOnly: readOnly} {
		_, err := deliver(t, "Post", dedupactivity.Wrap(d, b.post), Transfer{Account: "a", Amount: 1})
		require.ErrorIs(t, err, sentinel)
		require.False(t, errors.As(err, new(*temporal.ApplicationError)), "%v: as it is, not an ApplicationError", sentinel)
		f := temporal.GetDefaultFailureConverter().ErrorToFailure(err)
		require.False(t, f.GetApplicationFailureInfo().GetNonRetryable(), "%v: retryable", sentinel)
	}
	ended := spans.Ended()
	require.Len(t, ended, 1)
	require.Equal(t, "DedupReadOnly", attr(ended[0], "error.type").AsString(), "its error.type, by name (the alerts select it)")
}

// TestErrorTypeNames pins the ApplicationError types and error.type values
// by their text: workflows list them in RetryPolicy.NonRetryableErrorTypes
// and match Type() against them, and the alert rules and dashboards select
// them by name, so a renamed constant breaks them while every test that
// compares with the constant passes.
func TestErrorTypeNames(t *testing.T) {
	t.Parallel()
	require.Equal(t, "DedupPayloadMismatch", dedupactivity.ErrTypePayloadMismatch)
	require.Equal(t, "DedupClaimTimeout", dedupactivity.ErrTypeClaimTimeout)
	require.Equal(t, "DedupInvalidUsage", dedupactivity.ErrTypeInvalidUsage)
	require.Equal(t, "DedupResultTooLarge", dedupactivity.ErrTypeResultTooLarge)
	require.Equal(t, "DedupEncoding", dedupactivity.ErrTypeEncoding)
}

// TestMisuseIsNonRetryableAtTheEdge: an identity too large to store (a
// business key over MaxIdentityBytes) and a delivery the partitioned
// layout refuses (ErrInvalidOptions, a local activity) can never succeed
// as made, so they reach Temporal as non-retryable DedupInvalidUsage
// (TestBadCalls and TestPartitionedLayout checked only the sentinel and
// the message), and nothing is written.
func TestMisuseIsNonRetryableAtTheEdge(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(Transfer) (string, error) {
		return strings.Repeat("k", dedupactivity.MaxIdentityBytes+1), nil
	}))
	_, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 1})
	require.ErrorIs(t, err, dedupactivity.ErrIdentityTooLarge)
	f := temporal.GetDefaultFailureConverter().ErrorToFailure(err)
	require.Equal(t, dedupactivity.ErrTypeInvalidUsage, f.GetApplicationFailureInfo().GetType())
	require.True(t, f.GetApplicationFailureInfo().GetNonRetryable())
	require.Zero(t, b.markers(t))
	require.Zero(t, b.ledgerRows(t))

	// A local activity on the partitioned layout, which supports run-scoped
	// identities of regular and standalone activities only (ErrInvalidOptions).
	p := setup(t, dedupactivity.Options{PartitionInterval: time.Hour, Retention: time.Hour})
	local := dedupactivity.Wrap(p.d, p.post)
	var raw error
	driver := func(ctx context.Context, in Transfer) (Posting, error) {
		out, err := local(ctx, in)
		raw = err
		return out, err
	}
	var s testsuite.WorkflowTestSuite
	_, err = s.NewTestActivityEnvironment().ExecuteLocalActivity(driver, Transfer{Account: "a", Amount: 1})
	require.Error(t, err)
	require.ErrorIs(t, raw, dedupactivity.ErrInvalidOptions)
	f = temporal.GetDefaultFailureConverter().ErrorToFailure(raw)
	require.Equal(t, dedupactivity.ErrTypeInvalidUsage, f.GetApplicationFailureInfo().GetType())
	require.True(t, f.GetApplicationFailureInfo().GetNonRetryable(), "no retry of the local activity can succeed")
	require.Zero(t, p.ledgerRows(t))
}
