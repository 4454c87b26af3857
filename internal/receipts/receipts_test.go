package receipts_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/testsuite"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/receipts"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestCreditSendsOneReceipt runs the ledger's Credit activity (twice: a
// redelivery), relays its outbox to the receipts service on loopback (its
// own schema), re-sends as a relay that lost its acknowledgement would, and
// counts receipts at the destination by SQL.
func TestCreditSendsOneReceipt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ledger, dest := pgtest.NewSchema(t), pgtest.NewSchema(t)

	svc, err := receipts.New(dest.Pool)
	require.NoError(t, err)
	require.NoError(t, svc.Migrate(ctx))
	srv := httptest.NewServer(svc.Handler())
	t.Cleanup(srv.Close)

	d, err := dedupactivity.New(ledger.Pool, dedupactivity.Options{})
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	require.NoError(t, activities.Migrate(ctx, ledger.Pool))
	require.NoError(t, activities.OpenAccounts(ctx, ledger.Pool, 100, "a", "b"))
	ob, err := outbox.New(ledger.Pool, outbox.Options{})
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(ctx))
	acts := activities.New(d, ob)

	in := activities.Posting{TransferID: "t1", Account: "b", Amount: 7}
	for range 2 { // the same event delivered twice
		var suite testsuite.WorkflowTestSuite
		env := suite.NewTestActivityEnvironment()
		env.RegisterActivity(acts)
		_, err := env.ExecuteActivity(acts.Credit, in)
		require.NoError(t, err)
	}
	st, err := ob.Stats(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), st.Pending, "one receipt enqueued for one credit")

	sender, err := outbox.NewHTTPSender(outbox.HTTPSenderConfig{Endpoints: map[string]string{activities.ReceiptsDestination: srv.URL + receipts.ReceiptsPath}})
	require.NoError(t, err)
	relay, err := outbox.NewRelay(ob, outbox.RelayConfig{Sender: sender})
	require.NoError(t, err)
	res, err := relay.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res)

	// The acknowledgement is lost (as if the relay died after sending): the
	// message is due again and re-sent with the same key.
	_, err = ledger.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'pending', settled_at = NULL`)
	require.NoError(t, err)
	res, err = relay.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.RelayResult{Delivered: 1}, res)

	counts, err := receipts.Counts(ctx, dest.Pool, []string{"t1"})
	require.NoError(t, err)
	require.Equal(t, map[string]int{"t1": 1}, counts, "sent twice, stored once")
	var amount int64
	require.NoError(t, dest.Pool.QueryRow(ctx, `SELECT amount FROM receipt WHERE transfer_id = 't1'`).Scan(&amount))
	require.Equal(t, int64(7), amount)

	checker := outbox.HTTPChecker{URL: outbox.StatusURL(map[string]string{activities.ReceiptsDestination: srv.URL + receipts.StatusPath})}
	var key string
	require.NoError(t, ledger.Pool.QueryRow(ctx, `SELECT idempotency_key FROM dedup_outbox`).Scan(&key))
	applied, err := checker.Applied(ctx, outbox.Delivery{Key: key, Destination: activities.ReceiptsDestination})
	require.NoError(t, err)
	require.True(t, applied)
}

// TestPruneDeletesExpiredKeys stores two receipts, ages one key past its
// retention, and counts the key table by SQL before and after Prune: the
// expired key goes, the other stays.
func TestPruneDeletesExpiredKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dest := pgtest.NewSchema(t)
	svc, err := receipts.New(dest.Pool)
	require.NoError(t, err)
	require.NoError(t, svc.Migrate(ctx))
	srv := httptest.NewServer(svc.Handler())
	t.Cleanup(srv.Close)

	for _, key := range []string{"k-old", "k-new"} {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+receipts.ReceiptsPath,
			strings.NewReader(`{"TransferID":"t-`+key+`","Account":"a","Amount":1}`))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		require.Equal(t, http.StatusCreated, resp.StatusCode)
	}
	keys := func() (n int) {
		require.NoError(t, dest.Pool.QueryRow(ctx, `SELECT count(*) FROM dedup_marker`).Scan(&n))
		return n
	}
	require.Equal(t, 2, keys())
	// The first receipt's key is past its retention.
	_, err = dest.Pool.Exec(ctx, `UPDATE dedup_marker SET expires_at = now() - interval '1 second'
		WHERE claimed_at = (SELECT min(claimed_at) FROM dedup_marker)`)
	require.NoError(t, err)

	n, err := svc.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, 1, keys(), "the key within its retention stays")
}
