package dedupactivity_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// TransferV1 and TransferV2 are one activity input before and after a
// deploy: V2 adds fields (one omitempty) and orders them differently.
type TransferV1 struct {
	Account string
	Amount  int64
}

type TransferV2 struct {
	Amount  int64
	Memo    string
	Tags    []string `json:",omitempty"`
	Urgent  bool
	Account string
}

// TestInputsMayEvolve: a retry that straddles a deploy (the first attempt
// ran on V1, the retry decodes the same input into V2) is a duplicate, not a
// payload mismatch. Run-scoped identities are never compared (Temporal's
// history fixes their input); business keys compare by the documented rule,
// so only a real difference in a field's value is a mismatch.
func TestInputsMayEvolve(t *testing.T) {
	t.Parallel()
	v1 := func(b *testBundle) func(ctx context.Context, tx pgx.Tx, in TransferV1) (Posting, error) {
		return func(ctx context.Context, tx pgx.Tx, in TransferV1) (Posting, error) {
			return b.post(ctx, tx, Transfer(in))
		}
	}
	v2 := func(b *testBundle) func(ctx context.Context, tx pgx.Tx, in TransferV2) (Posting, error) {
		return func(ctx context.Context, tx pgx.Tx, in TransferV2) (Posting, error) {
			return b.post(ctx, tx, Transfer{Account: in.Account, Amount: in.Amount})
		}
	}
	t.Run("RunScoped", func(t *testing.T) {
		t.Parallel()
		b := setup(t, dedupactivity.Options{})
		first, err := deliver(t, "Post", dedupactivity.Wrap(b.d, v1(b)), TransferV1{Account: "a", Amount: 5})
		require.NoError(t, err)
		// Even a value V1 could not have sent: the identity's input is fixed.
		again, err := deliver(t, "Post", dedupactivity.Wrap(b.d, v2(b)), TransferV2{Account: "a", Amount: 5, Memo: "new field"})
		require.NoError(t, err)
		require.Equal(t, first, again)
		require.Equal(t, int64(1), b.ledgerRows(t))
	})
	t.Run("BusinessKey", func(t *testing.T) {
		t.Parallel()
		b := setup(t, dedupactivity.Options{})
		fn1 := dedupactivity.Wrap(b.d, v1(b), dedupactivity.WithBusinessKey(func(in TransferV1) (string, error) { return "order-1", nil }))
		fn2 := dedupactivity.Wrap(b.d, v2(b), dedupactivity.WithBusinessKey(func(in TransferV2) (string, error) { return "order-1", nil }))
		first, err := deliver(t, "Post", fn1, TransferV1{Account: "a", Amount: 5})
		require.NoError(t, err)
		again, err := deliver(t, "Post", fn2, TransferV2{Account: "a", Amount: 5})
		require.NoError(t, err, "added fields at their zero value, other order: the same input")
		require.Equal(t, first, again)
		_, err = deliver(t, "Post", fn2, TransferV2{Account: "a", Amount: 5, Tags: []string{}})
		require.NoError(t, err, "an empty list is a zero value")

		_, err = deliver(t, "Post", fn2, TransferV2{Account: "a", Amount: 5, Memo: "x"})
		require.ErrorIs(t, err, dedupactivity.ErrPayloadMismatch, "a field with a value is a different input")
		_, err = deliver(t, "Post", fn1, TransferV1{Account: "a", Amount: 6})
		require.ErrorIs(t, err, dedupactivity.ErrPayloadMismatch)
		require.Equal(t, int64(1), b.ledgerRows(t))
	})
}
