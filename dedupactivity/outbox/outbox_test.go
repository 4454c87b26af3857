package outbox_test

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	outboxsql "github.com/dedupactivity/dedupactivity/migrations/outbox"
)

func TestMain(m *testing.M) {
	pgtest.Main(m)
}

type testBundle struct {
	schema *pgtest.Schema
	d      *dedupactivity.Deduper
	ob     *outbox.Outbox
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	s := pgtest.NewSchema(t)
	ctx := context.Background()
	d, err := dedupactivity.New(s.Pool, dedupactivity.Options{})
	require.NoError(t, err)
	require.NoError(t, d.Migrate(ctx))
	ob, err := outbox.New(s.Pool, outbox.Options{})
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(ctx))
	_, err = s.Pool.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, order_id text NOT NULL)`)
	require.NoError(t, err)
	return &testBundle{schema: s, d: d, ob: ob}
}

func (b *testBundle) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.schema.Pool.QueryRow(context.Background(), query, args...).Scan(&n))
	return n
}

// Order is the test effect's input.
type Order struct{ ID string }

// orderID builds the business-key identity of an order.
func orderID(id string) dedupactivity.Identity {
	return dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "test", ActivityType: "PlaceOrder", Key: id}
}

// place applies an order: one effect row and the messages named by names,
// then fail (if non-nil) to make the effect roll back. It returns the keys
// Enqueue returned.
func (b *testBundle) place(t *testing.T, id string, names []string, fail error) ([]string, dedupactivity.Outcome, error) {
	t.Helper()
	var keys []string
	_, outcome, err := dedupactivity.Do(context.Background(), b.d, orderID(id), Order{ID: id},
		func(ctx context.Context, tx pgx.Tx, in Order) (int, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO effect (order_id) VALUES ($1)`, in.ID); err != nil {
				return 0, err
			}
			for _, n := range names {
				k, err := b.ob.Enqueue(ctx, tx, outbox.Message{Destination: "receipts", Name: n,
					Payload: map[string]string{"order": in.ID}, Headers: map[string]string{"X-Order": in.ID}})
				if err != nil {
					return 0, err
				}
				keys = append(keys, k)
			}
			return len(names), fail
		})
	return keys, outcome, err
}

func TestEnqueueCommitsWithEffect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	keys, outcome, err := b.place(t, "o1", []string{"receipt", "email"}, nil)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effect`))
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'pending'`))
	for _, k := range keys {
		require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE idempotency_key = $1`, k))
	}
	var payload []byte
	var headers map[string]string
	require.NoError(t, b.schema.Pool.QueryRow(context.Background(),
		`SELECT payload, headers FROM dedup_outbox WHERE idempotency_key = $1`, keys[0]).Scan(&payload, &headers))
	require.JSONEq(t, `{"order":"o1"}`, string(payload))
	require.Equal(t, map[string]string{"X-Order": "o1"}, headers)

	// A duplicate delivery runs nothing and enqueues nothing.
	again, outcome, err := b.place(t, "o1", []string{"receipt", "email"}, nil)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Empty(t, again)
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effect`))
}

func TestEnqueueRollsBackWithEffect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	boom := errors.New("boom")
	keys, outcome, err := b.place(t, "o1", []string{"receipt"}, boom)
	require.ErrorIs(t, err, boom)
	require.Equal(t, dedupactivity.OutcomeEffectError, outcome)
	require.Len(t, keys, 1, "the message was enqueued before the effect failed")
	require.Zero(t, b.count(t, `SELECT count(*) FROM dedup_outbox`), "and rolled back with it")
	require.Zero(t, b.count(t, `SELECT count(*) FROM effect`))
}

func TestEnqueueKeyStableAcrossAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// Attempt 1 enqueues and fails; attempt 2 succeeds: same keys.
	first, _, err := b.place(t, "o1", []string{"receipt", "receipt", "email"}, errors.New("attempt 1 fails"))
	require.Error(t, err)
	second, outcome, err := b.place(t, "o1", []string{"receipt", "receipt", "email"}, nil)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeClaimed, outcome)
	require.Equal(t, first, second)

	h := orderID("o1").Hash()
	eventKey := "dedup-" + hex.EncodeToString(h[:])
	require.Equal(t, []string{eventKey + ":receipt:0", eventKey + ":receipt:1", eventKey + ":email:0"}, second)

	// Another event never shares a key.
	other, _, err := b.place(t, "o2", []string{"receipt", "receipt", "email"}, nil)
	require.NoError(t, err)
	for _, k := range other {
		require.NotContains(t, second, k)
	}
	require.Equal(t, 6, b.count(t, `SELECT count(DISTINCT idempotency_key) FROM dedup_outbox`))
}

func TestEnqueueOutsideEffect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
		_, err := b.ob.Enqueue(ctx, tx, outbox.Message{Destination: "receipts"})
		return err
	})
	require.ErrorIs(t, err, outbox.ErrNoEventKey)

	enqueue := func(key string) error {
		return pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
			got, err := b.ob.Enqueue(ctx, tx, outbox.Message{Destination: "receipts", Key: key, Payload: json.RawMessage(`{"a":1}`)})
			if err == nil {
				require.Equal(t, key, got)
			}
			return err
		})
	}
	require.NoError(t, enqueue("explicit-1"))
	require.ErrorIs(t, enqueue("explicit-1"), outbox.ErrDuplicateKey)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox`))
}

func TestEnqueueRejectsBadMessages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for name, msg := range map[string]outbox.Message{
		"no destination": {Key: "k"},
		"bad name":       {Destination: "d", Name: "a:b", Key: "k"},
		"bad json":       {Destination: "d", Key: "k", Payload: json.RawMessage(`{`)},
		"unencodable":    {Destination: "d", Key: "k", Payload: make(chan int)},
		"header name":    {Destination: "d", Key: "k", Headers: map[string]string{"Bad Name": "v"}},
		"header value":   {Destination: "d", Key: "k", Headers: map[string]string{"X-Note": "a\r\nX-Injected: 1"}},
		// Stored in jsonb, it would come back with U+FFFD for the byte.
		"header value not UTF-8": {Destination: "d", Key: "k", Headers: map[string]string{"X-Name": "Jos\xe9"}},
		// One header for HTTP: each send would carry either value.
		"header names differing in case": {Destination: "d", Key: "k", Headers: map[string]string{"X-Tenant": "a", "x-tenant": "b"}},
		// Text columns refuse these with SQLSTATE 22021, which a retry
		// cannot fix.
		"NUL in destination":    {Destination: "rece\x00ipts", Key: "k"},
		"destination not UTF-8": {Destination: "rece\xffipts", Key: "k"},
		"NUL in key":            {Destination: "d", Key: "k\x003"},
		"key not UTF-8":         {Destination: "d", Key: "k\xff"},
		// Sent as the Idempotency-Key header: net/http refuses a line
		// break at every send, HTTP trims spaces, idemhttp refuses a key
		// longer than 255 bytes.
		"line break in key":      {Destination: "d", Key: "order-1\r\nX-Injected: 1"},
		"key with a space after": {Destination: "d", Key: "order-1 "},
		"key too long":           {Destination: "d", Key: strings.Repeat("k", 256)},
	} {
		err := pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
			_, err := b.ob.Enqueue(ctx, tx, msg)
			return err
		})
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, name)
	}
	require.Zero(t, b.count(t, `SELECT count(*) FROM dedup_outbox`))
	err := pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
		_, err := b.ob.Enqueue(ctx, tx, outbox.Message{Destination: "d", Key: strings.Repeat("k", 255), Headers: map[string]string{"X-Name": "José"}})
		return err
	})
	require.NoError(t, err, "the longest key, a header in UTF-8")
}

// TestEnqueueInAPlainActivityNeedsAKey: a plain activity (no EffectFunc)
// whose first attempt committed its message and then failed must not derive
// a new key on its retry, which would count the committed message and send
// a second one. Enqueue needs an explicit Key there, as anywhere outside an
// EffectFunc.
func TestEnqueueInAPlainActivityNeedsAKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var mu sync.Mutex
	var errs []error
	act := func(ctx context.Context) error {
		err := pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
			_, err := b.ob.Enqueue(ctx, tx, outbox.Message{Destination: "receipts", Name: "receipt"})
			return err
		})
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
		if err != nil {
			return temporal.NewNonRetryableApplicationError(err.Error(), "Enqueue", nil)
		}
		if activity.GetInfo(ctx).Attempt == 1 {
			return errors.New("completion lost after the commit")
		}
		return nil
	}
	wf := func(ctx workflow.Context) error {
		ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{StartToCloseTimeout: 10 * time.Second,
			RetryPolicy: &temporal.RetryPolicy{InitialInterval: time.Millisecond, MaximumAttempts: 2}})
		return workflow.ExecuteActivity(ctx, "SendReceipt").Get(ctx, nil)
	}
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestWorkflowEnvironment()
	env.RegisterWorkflowWithOptions(wf, workflow.RegisterOptions{Name: "W"})
	env.RegisterActivityWithOptions(act, activity.RegisterOptions{Name: "SendReceipt"})
	env.ExecuteWorkflow("W")
	require.Error(t, env.GetWorkflowError())
	require.Len(t, errs, 1)
	require.ErrorIs(t, errs[0], outbox.ErrNoEventKey)
	require.Zero(t, b.count(t, `SELECT count(*) FROM dedup_outbox`))
}

func TestMigrateIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	ob, err := outbox.New(s.Pool, outbox.Options{Schema: s.Name + "_ob", Table: "my_outbox"})
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = pgtestDrop(s, s.Name+"_ob") })
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for range 6 {
		wg.Go(func() { errs <- ob.Migrate(context.Background()) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	var n int
	require.NoError(t, s.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+s.Name+`_ob.my_outbox_migration`).Scan(&n))
	ups, err := fs.Glob(outboxsql.FS, "*.up.sql")
	require.NoError(t, err)
	require.Equal(t, len(ups), n, "one version per migration file")
	st, err := ob.Stats(context.Background())
	require.NoError(t, err)
	require.Zero(t, st.Enqueued())

	// Outboxes and marker tables migrated at once into one new schema do
	// not race on creating it.
	for round := range 5 {
		schema := fmt.Sprintf("%s_new%d", s.Name, round)
		t.Cleanup(func() { _, _ = pgtestDrop(s, schema) })
		var migrate []func(context.Context) error
		for i := range 4 {
			ob, err := outbox.New(s.Pool, outbox.Options{Schema: schema, Table: fmt.Sprintf("outbox_%d", i)})
			require.NoError(t, err)
			d, err := dedupactivity.New(s.Pool, dedupactivity.Options{Schema: schema, Table: fmt.Sprintf("markers_%d", i)})
			require.NoError(t, err)
			migrate = append(migrate, ob.Migrate, d.Migrate)
		}
		errs := make(chan error, len(migrate))
		for _, m := range migrate {
			wg.Go(func() { errs <- m(context.Background()) })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err, "round %d", round)
		}
	}
}

// TestMigrateWaitsBrieflyForTheTable: a Migrate that must lock the outbox
// table (a later release's upgrade; here the files run again on a table
// whose record of versions was lost, and CREATE INDEX IF NOT EXISTS locks
// the table before it finds the index) behind a long transaction that
// wrote to it (an effect still running after its Enqueue) gives up its lock
// wait after migrateLockTimeout with SQLSTATE 55P03, instead of waiting as
// long as that transaction with every other Enqueue queued behind its lock
// request; called again once the table is free, it records the version.
func TestMigrateWaitsBrieflyForTheTable(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	_, err := b.schema.Pool.Exec(ctx, `DELETE FROM dedup_outbox_migration`)
	require.NoError(t, err)

	holder, err := b.schema.Pool.Begin(ctx)
	require.NoError(t, err)
	defer holder.Rollback(ctx)
	_, err = b.ob.Enqueue(ctx, holder, outbox.Message{Key: "held", Destination: "receipts", Name: "receipt", Payload: []byte("{}")})
	require.NoError(t, err)

	migrated := make(chan error, 1)
	began := time.Now()
	go func() { migrated <- b.ob.Migrate(ctx) }()
	time.Sleep(100 * time.Millisecond) // Migrate waits for the table
	placed := make(chan time.Duration, 1)
	go func() {
		start := time.Now()
		tx, err := b.schema.Pool.Begin(ctx)
		if err == nil {
			_, err = b.ob.Enqueue(ctx, tx, outbox.Message{Key: "o1", Destination: "receipts", Name: "receipt", Payload: []byte("{}")})
			err = errors.Join(err, tx.Commit(ctx))
		}
		if err != nil {
			start = time.Time{} // reported as a wait of ages
		}
		placed <- time.Since(start)
	}()
	select {
	case err = <-migrated:
	case <-time.After(10 * time.Second):
		t.Fatal("Migrate still waits for the long transaction")
	}
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "55P03", pgErr.Code, "%v", err)
	require.ErrorContains(t, err, "held the table")
	require.Less(t, time.Since(began), 5*time.Second)
	require.Less(t, <-placed, 2*time.Second, "an Enqueue waited only while Migrate did")

	require.NoError(t, holder.Rollback(ctx))
	require.NoError(t, b.ob.Migrate(ctx))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox_migration WHERE version = 1`))
}

func pgtestDrop(s *pgtest.Schema, schema string) (int, error) {
	_, err := s.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
	return 0, err
}

func TestNotMigrated(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	ob, err := outbox.New(s.Pool, outbox.Options{})
	require.NoError(t, err)
	_, err = ob.Stats(context.Background())
	require.ErrorIs(t, err, outbox.ErrNotMigrated)
}

func TestOptionsValidate(t *testing.T) {
	t.Parallel()
	s := pgtest.NewSchema(t)
	for name, o := range map[string]outbox.Options{
		"table":     {Table: "Bad-Name"},
		"schema":    {Schema: "x;drop"},
		"pg_temp":   {Schema: "pg_temp"},
		"retention": {Retention: time.Second},
	} {
		_, err := outbox.New(s.Pool, o)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, name)
	}
	_, err := outbox.New(nil, outbox.Options{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

func TestPrune(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for _, id := range []string{"o1", "o2", "o3", "o4", "o5", "o6"} {
		_, _, err := b.place(t, id, []string{"receipt"}, nil)
		require.NoError(t, err)
	}
	_, err := b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = v.state, settled_at = now() - v.age::interval
FROM (VALUES ('o1', 'sent', '31 days'), ('o2', 'applied', '31 days'), ('o3', 'dead', '31 days'), ('o5', 'rejected', '31 days'),
	('o6', 'rejected', '1 day')) AS v(order_id, state, age)
WHERE convert_from(payload, 'UTF8')::jsonb->>'order' = v.order_id`)
	require.NoError(t, err)
	// The prune activity's Prune, past the time it may begin a batch
	// (a minute before its deadline): it deletes nothing, and says so.
	n, outOfTime, err := outbox.PruneUntil(ctx, b.ob, time.Now().Add(-time.Second))
	require.NoError(t, err)
	require.True(t, outOfTime)
	require.Zero(t, n)
	n, outOfTime, err = outbox.PruneUntil(ctx, b.ob, time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.False(t, outOfTime)
	require.Equal(t, int64(3), n, "sent, applied and rejected past Retention")
	n, err = b.ob.Prune(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "nothing left")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'rejected'`), "the rejected one within Retention")
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state IN ('dead', 'pending')`))

	// The same through the prune workflow RegisterPruner registers (what
	// EnsurePruneSchedule runs).
	for _, id := range []string{"o7", "o8"} {
		_, _, err := b.place(t, id, []string{"receipt"}, nil)
		require.NoError(t, err)
	}
	_, err = b.schema.Pool.Exec(ctx, `UPDATE dedup_outbox SET state = 'sent', settled_at = now() - interval '31 days' WHERE state = 'pending' AND convert_from(payload, 'UTF8')::jsonb->>'order' IN ('o7', 'o8')`)
	require.NoError(t, err)
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestWorkflowEnvironment()
	outbox.RegisterPruner(env, b.ob)
	env.ExecuteWorkflow("DedupOutboxPrune", outbox.PruneActivityName(b.ob))
	require.NoError(t, env.GetWorkflowError())
	var res outbox.PruneResult
	require.NoError(t, env.GetWorkflowResult(&res))
	require.Equal(t, outbox.PruneResult{Deleted: 2}, res)
	require.Zero(t, b.count(t, `SELECT count(*) FROM dedup_outbox WHERE state = 'sent'`))
}

// destination is a test HTTP destination on loopback that records every
// request and answers as respond says.
type destination struct {
	*httptest.Server
	mu       sync.Mutex
	received map[string]int // idempotency key -> requests
	inFlight map[string]int
	overlap  int // requests that arrived while another with the same key was in flight
	headers  []http.Header
	respond  func(key string, n int) int // status for the n-th request (1-based) of key
	delay    time.Duration
}

func newDestination(t *testing.T, respond func(key string, n int) int) *destination {
	t.Helper()
	d := &destination{received: map[string]int{}, inFlight: map[string]int{}, respond: respond}
	d.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		key := r.Header.Get("Idempotency-Key")
		d.mu.Lock()
		d.received[key]++
		n := d.received[key]
		if d.inFlight[key] > 0 {
			d.overlap++
		}
		d.inFlight[key]++
		d.headers = append(d.headers, r.Header.Clone())
		delay := d.delay
		d.mu.Unlock()
		time.Sleep(delay)
		d.mu.Lock()
		d.inFlight[key]--
		d.mu.Unlock()
		status := http.StatusOK
		if d.respond != nil {
			status = d.respond(key, n)
		}
		w.WriteHeader(status)
		_, _ = io.WriteString(w, http.StatusText(status))
	}))
	t.Cleanup(d.Close)
	return d
}

func (d *destination) count(key string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.received[key]
}

func (d *destination) total() (requests, keys int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, n := range d.received {
		requests += n
	}
	return requests, len(d.received)
}

// TestBacklogUsesTheStateIndexes: the count the outbox's gauges read at each
// collection reads the waiting messages through their partial indexes, not
// the settled ones the table keeps for Retention (an IN list over the
// states would scan them all).
func TestBacklogUsesTheStateIndexes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	_, err := b.schema.Pool.Exec(ctx, `INSERT INTO dedup_outbox (idempotency_key, event_key, destination, name, payload, state, settled_at)
SELECT 'k' || g, '', 'receipts', 'receipt', '\x00', CASE WHEN g % 1000 = 0 THEN 'pending' WHEN g % 1000 = 1 THEN 'dead' ELSE 'sent' END, now()
FROM generate_series(1, 50000) g`)
	require.NoError(t, err)
	_, err = b.schema.Pool.Exec(ctx, `ANALYZE dedup_outbox`)
	require.NoError(t, err)
	var plan strings.Builder
	rows, err := b.schema.Pool.Query(ctx, `EXPLAIN `+outbox.BacklogQuery(b.ob))
	require.NoError(t, err)
	for rows.Next() {
		var line string
		require.NoError(t, rows.Scan(&line))
		plan.WriteString(line + "\n")
	}
	require.NoError(t, rows.Err())
	require.NotContains(t, plan.String(), "Seq Scan", plan.String())
	for _, idx := range []string{"dedup_outbox_due_idx", "dedup_outbox_lease_idx", "dedup_outbox_dead_idx"} {
		require.Contains(t, plan.String(), idx)
	}
}

// TestMigrateAsLeastPrivilegeRole: on an up-to-date outbox, Migrate only
// reads its version table, so a worker's role that may not create tables
// or schemas runs it at start, with and without Options.Schema.
func TestMigrateAsLeastPrivilegeRole(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pool := b.schema.RolePool(t, "ob_"+b.schema.Name, `
GRANT USAGE ON SCHEMA %[1]s TO %[2]s;
GRANT SELECT ON %[1]s.dedup_outbox_migration TO %[2]s;
GRANT SELECT, INSERT, UPDATE, DELETE ON %[1]s.dedup_outbox TO %[2]s;`)

	for _, opts := range []outbox.Options{{}, {Schema: b.schema.Name}} {
		ob, err := outbox.New(pool, opts)
		require.NoError(t, err)
		require.NoError(t, ob.Migrate(ctx), "an up-to-date outbox needs no CREATE (Schema %q)", opts.Schema)
	}
	_, err := pool.Exec(ctx, `CREATE TABLE nope (id int)`)
	require.Error(t, err, "the role cannot create tables")

	// A version missing from the record: Migrate needs the owner again.
	_, err = b.schema.Pool.Exec(ctx, `DELETE FROM dedup_outbox_migration WHERE version = (SELECT max(version) FROM dedup_outbox_migration)`)
	require.NoError(t, err)
	ob, err := outbox.New(pool, outbox.Options{})
	require.NoError(t, err)
	require.Error(t, ob.Migrate(ctx), "the role may not migrate")
	require.NoError(t, b.ob.Migrate(ctx), "the owner applies it again (idempotent)")
}

// TestMigrateInASchemaADBAMade: a role that may create tables in an existing
// schema (USAGE and CREATE on it) and not schemas (no CREATE on the
// database) migrates with Options.Schema naming it. Before, its CREATE
// SCHEMA IF NOT EXISTS failed with "permission denied for database"
// (42501), which PostgreSQL checks before it looks for the schema.
func TestMigrateInASchemaADBAMade(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	schema := pgx.Identifier{b.schema.Name + "_app"}.Sanitize()
	_, err := b.schema.Pool.Exec(ctx, `CREATE SCHEMA `+schema)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = b.schema.Pool.Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`)
	})
	pool := b.schema.RolePool(t, "os_"+b.schema.Name, `GRANT USAGE, CREATE ON SCHEMA `+schema+` TO %[2]s;`)

	ob, err := outbox.New(pool, outbox.Options{Schema: b.schema.Name + "_app"})
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(ctx))
	var there bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, schema+".dedup_outbox").Scan(&there))
	require.True(t, there)
}

// TestMigrateMakesADroppedTableAgain: an outbox table dropped by hand,
// its version record left behind, is made again by Migrate, not taken for
// migrated (every Enqueue would fail).
func TestMigrateMakesADroppedTableAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	_, err := b.schema.Pool.Exec(ctx, `DROP TABLE dedup_outbox`)
	require.NoError(t, err)
	require.NoError(t, b.ob.Migrate(ctx))
	_, _, err = b.place(t, "o1", []string{"receipt"}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox`))
}

// TestReservedWordNames: any name New accepts works as Table and Schema,
// reserved words included: Migrate (twice), Enqueue, the relay and Prune.
// The migration's names were unquoted, so New took Table "order" and
// Migrate failed on it with a syntax error.
func TestReservedWordNames(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	// Schema "limit" is the database's, not this test's own: another run
	// of this test on the same TEST_DATABASE_URL waits for this one.
	lock, err := b.schema.Pool.Acquire(ctx)
	require.NoError(t, err)
	_, err = lock.Exec(ctx, `SELECT pg_advisory_lock(hashtext('outbox TestReservedWordNames'))`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = lock.Exec(context.Background(), `SELECT pg_advisory_unlock(hashtext('outbox TestReservedWordNames'))`)
		lock.Release()
	})
	dropLimit := func() { _, _ = b.schema.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS "limit" CASCADE`) }
	dropLimit() // left by a run killed midway, under TEST_DATABASE_URL
	t.Cleanup(dropLimit)
	dest := newDestination(t, func(string, int) int { return http.StatusOK })
	for _, opts := range []outbox.Options{{Table: "order"}, {Schema: "limit", Table: "user"}} {
		ob, err := outbox.New(b.schema.Pool, opts)
		require.NoError(t, err)
		require.NoError(t, ob.Migrate(ctx), "%+v", opts)
		require.NoError(t, ob.Migrate(ctx), "%+v, migrated", opts)
		b.ob = ob
		id := "o-" + opts.Table
		keys, _, err := b.place(t, id, []string{"receipt"}, nil)
		require.NoError(t, err)
		res, err := b.relay(t, dest, outbox.RelayConfig{}).RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, res.Delivered, "%+v", opts)

		table := pgx.Identifier{opts.Table}
		if opts.Schema != "" {
			table = pgx.Identifier{opts.Schema, opts.Table}
		}
		_, err = b.schema.Pool.Exec(ctx, `UPDATE `+table.Sanitize()+` SET settled_at = now() - interval '31 days'`)
		require.NoError(t, err)
		n, err := ob.Prune(ctx)
		require.NoError(t, err)
		require.Equal(t, int64(1), n, "%+v", opts)
		require.Zero(t, b.count(t, `SELECT count(*) FROM `+table.Sanitize()), "%+v", opts)
		dest.mu.Lock()
		require.Equal(t, 1, dest.received[keys[0]], "%+v", opts)
		dest.mu.Unlock()

		// The down file, renamed as a migration tool would, drops both
		// tables, and Migrate makes them again.
		down, err := fs.ReadFile(outboxsql.FS, "001_create_dedup_outbox.down.sql")
		require.NoError(t, err)
		require.NoError(t, pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
			if opts.Schema != "" {
				if _, err := tx.Exec(ctx, `SET LOCAL search_path = "limit"`); err != nil {
					return err
				}
			}
			_, err := tx.Exec(ctx, strings.ReplaceAll(string(down), outboxsql.TableToken, opts.Table))
			return err
		}), "%+v", opts)
		schema := opts.Schema
		if schema == "" {
			schema = b.schema.Name
		}
		require.Zero(t, b.count(t, `SELECT count(to_regclass(format('%I.%I', $1::text, t))) FROM unnest(ARRAY[$2::text, $2::text || '_migration']) AS t`, schema, opts.Table), "%+v", opts)
		require.NoError(t, ob.Migrate(ctx), "%+v, after the down file", opts)
	}
}

// TestMigrateBesideAnOutboxLaterInSearchPath: without Options.Schema, an
// outbox table (migrated, its version table there too) further down
// search_path is not taken for this one: Migrate makes the outbox in
// current_schema(), where Enqueue and the relay find it first, both when
// nothing is there yet and when the table there was dropped by hand with
// its version record left.
func TestMigrateBesideAnOutboxLaterInSearchPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	first, later := pgtest.NewSchema(t), pgtest.NewSchema(t)
	theirs, err := outbox.New(later.Pool, outbox.Options{Schema: later.Name})
	require.NoError(t, err)
	require.NoError(t, theirs.Migrate(ctx))
	url, err := pgtest.WithSearchPath(pgtest.RequireServer(t).URL, first.Name+","+later.Name)
	require.NoError(t, err)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	ob, err := outbox.New(pool, outbox.Options{})
	require.NoError(t, err)
	inFirst := func() bool {
		var there bool
		require.NoError(t, first.Pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, pgx.Identifier{first.Name, "dedup_outbox"}.Sanitize()).Scan(&there))
		return there
	}

	require.NoError(t, ob.Migrate(ctx))
	require.True(t, inFirst(), "the outbox made in current_schema()")

	_, err = first.Pool.Exec(ctx, `DROP TABLE dedup_outbox`)
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(ctx))
	require.True(t, inFirst(), "the outbox dropped by hand made again in current_schema()")
}

// TestOutboxColumns: the columns Migrate requires of an outbox table it
// finds are those its migration makes, no more and no fewer.
func TestOutboxColumns(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rows, err := b.schema.Pool.Query(context.Background(), `SELECT attname::text FROM pg_attribute WHERE attrelid = 'dedup_outbox'::regclass AND attnum > 0 AND NOT attisdropped`)
	require.NoError(t, err)
	columns, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.ElementsMatch(t, columns, outbox.OutboxColumns)
}

// TestMigrateRefusesAForeignTable: a table of the outbox's name that lacks
// an outbox's columns (made by something else) is refused with
// ErrInvalidConfig naming them, whether a version record is there or not,
// and left as it was; CREATE TABLE IF NOT EXISTS would have kept it, and
// every Enqueue failed on it.
func TestMigrateRefusesAForeignTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, recorded := range []bool{false, true} {
		s := pgtest.NewSchema(t)
		_, err := s.Pool.Exec(ctx, `CREATE TABLE dedup_outbox (id bigserial PRIMARY KEY, payload bytea, state text)`)
		require.NoError(t, err)
		if recorded {
			_, err = s.Pool.Exec(ctx, `CREATE TABLE dedup_outbox_migration (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
INSERT INTO dedup_outbox_migration (version, name) VALUES (1, 'create_dedup_outbox')`)
			require.NoError(t, err)
		}
		ob, err := outbox.New(s.Pool, outbox.Options{})
		require.NoError(t, err)
		err = ob.Migrate(ctx)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "recorded %v", recorded)
		require.ErrorContains(t, err, "idempotency_key", "recorded %v", recorded)
		var n int
		require.NoError(t, s.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_attribute WHERE attrelid = 'dedup_outbox'::regclass AND attnum > 0 AND NOT attisdropped`).Scan(&n))
		require.Equal(t, 3, n, "the table left as it was")
	}
}

// TestEnqueueRefusesALongName pins the 100-byte bound of Message.Name
// ([A-Za-z0-9._-]{1,100}): a derived key is "dedup-<64 hex>:<name>:<n>",
// and only with the bound does it stay within the 255 bytes that HTTPSender
// and idemhttp accept for an Idempotency-Key. A name of 100 bytes is
// enqueued with a key of at most 255 bytes; one of 101 is refused with
// ErrInvalidMessage and writes nothing (counted by SQL). A bound removed
// would let a long name through, to go dead at every send.
func TestEnqueueRefusesALongName(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	keys, _, err := b.place(t, "o1", []string{strings.Repeat("n", 100)}, nil)
	require.NoError(t, err)
	require.Len(t, keys, 1)
	require.LessOrEqual(t, len(keys[0]), 255, "the derived key fits an Idempotency-Key")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox`))

	for _, name := range []string{strings.Repeat("n", 101), strings.Repeat("n", 200)} {
		_, _, err := b.place(t, "long-"+name, []string{name}, nil)
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, len(name))
		err = pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
			_, err := b.ob.Enqueue(ctx, tx, outbox.Message{Destination: "d", Name: name, Key: "explicit-" + name[:3]})
			return err
		})
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, len(name))
	}
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM dedup_outbox`), "nothing more was written")
}

// TestEnqueueRefusesAnUnstorableDestinationWithAName pins Enqueue's own
// check of Destination (valid UTF-8 without NUL) when Name is given: with
// Name unset the name check, which defaults Name to Destination, hid it.
// Without the check the INSERT fails in PostgreSQL (SQLSTATE 22021), which
// is not ErrInvalidMessage and aborts the effect's transaction, so the
// effect could not even go on without the message. With it the error is
// ErrInvalidMessage and the transaction still runs statements.
func TestEnqueueRefusesAnUnstorableDestinationWithAName(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for _, dest := range []string{"rece\x00ipts", "rece\xffipts"} {
		err := pgx.BeginFunc(ctx, b.schema.Pool, func(tx pgx.Tx) error {
			_, err := b.ob.Enqueue(ctx, tx, outbox.Message{Destination: dest, Name: "receipt", Key: "k"})
			require.ErrorIs(t, err, outbox.ErrInvalidMessage, "%q", dest)
			_, err = tx.Exec(ctx, `INSERT INTO effect (order_id) VALUES ('still-running')`)
			require.NoError(t, err, "the transaction was not aborted by a failed statement")
			return errors.New("roll back")
		})
		require.Error(t, err)
	}
	require.Zero(t, b.count(t, `SELECT count(*) FROM dedup_outbox`))
}
