package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/event"
	"github.com/dedupactivity/dedupactivity/dedupactivity/internal/pgschema"
	"github.com/dedupactivity/dedupactivity/migrations/outbox"
)

// DefaultTable is the outbox table's name.
const DefaultTable = outbox.TableToken

// DefaultRetention is how long sent and applied messages are kept at least
// (as the markers': 30 days).
const DefaultRetention = dedupactivity.DefaultRetention

// Options configure an Outbox. The zero value is valid.
type Options struct {
	// Schema holds the outbox table, a plain lower-case identifier, not one
	// of PostgreSQL's own (pg_ prefix).
	//
	// Defaults to "": the table is found through the search_path.
	Schema string

	// Table is the outbox table's name, a plain lower-case identifier of at
	// most 40 bytes.
	//
	// Defaults to DefaultTable ("dedup_outbox").
	Table string

	// Retention is how long Prune keeps sent, applied and rejected
	// messages after they settled. Dead messages are never pruned: the
	// reconciler or a person settles them first.
	//
	// Defaults to DefaultRetention (30 days).
	Retention time.Duration

	// MeterProvider creates the meter for MetricMessages and
	// MetricOldestPendingAge, which New registers once for the table: they
	// are read by one indexed query at each collection. Relays and
	// reconcilers take their own (RelayConfig, ReconcilerConfig).
	//
	// Defaults to otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
}

var identRE = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

func (o Options) withDefaults() Options {
	if o.Table == "" {
		o.Table = DefaultTable
	}
	if o.Retention == 0 {
		o.Retention = DefaultRetention
	}
	if o.MeterProvider == nil {
		o.MeterProvider = otel.GetMeterProvider()
	}
	return o
}

func (o Options) validate() error {
	if o.Schema != "" && (len(o.Schema) > 63 || !identRE.MatchString(o.Schema)) {
		return fmt.Errorf("%w: Schema %q must match [a-z_][a-z0-9_]* and be at most 63 bytes", ErrInvalidConfig, o.Schema)
	}
	if strings.HasPrefix(o.Schema, "pg_") {
		// pg_temp above all: each session's own temporary schema, which
		// other connections do not see.
		return fmt.Errorf("%w: Schema %q: the pg_ prefix is PostgreSQL's (pg_catalog, pg_toast, pg_temp: a session's temporary schema, which other connections do not see)", ErrInvalidConfig, o.Schema)
	}
	if len(o.Table) > 40 || !identRE.MatchString(o.Table) {
		return fmt.Errorf("%w: Table %q must match [a-z_][a-z0-9_]* and be at most 40 bytes", ErrInvalidConfig, o.Table)
	}
	if o.Retention < time.Minute {
		return fmt.Errorf("%w: Retention must be at least 1m, got %s", ErrInvalidConfig, o.Retention)
	}
	return nil
}

// Outbox is a transactional outbox table: messages enqueued through an
// effect's pgx.Tx commit exactly when the effect does. It is safe for
// concurrent use.
type Outbox struct {
	pool  *pgxpool.Pool
	opts  Options
	table string // qualified and quoted
	name  string // qualified, unquoted: the dedup.outbox.table label, in activity names
}

// New returns an Outbox on pool. opts is checked; an error names the field
// at fault and wraps ErrInvalidConfig. New registers the backlog gauges
// (MetricMessages, MetricOldestPendingAge) with Options.MeterProvider for
// the life of the process, each read by one query per collection: make one
// Outbox per table and share it (it is safe for concurrent use).
func New(pool *pgxpool.Pool, opts Options) (*Outbox, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidConfig)
	}
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	ob := &Outbox{pool: pool, opts: opts, name: opts.Table}
	ob.table = pgx.Identifier{opts.Table}.Sanitize()
	if opts.Schema != "" {
		ob.table = pgx.Identifier{opts.Schema, opts.Table}.Sanitize()
		ob.name = opts.Schema + "." + opts.Table // tables of one name in two schemas: two series, two activities
	}
	if err := observeBacklog(opts.MeterProvider.Meter(ScopeName), ob); err != nil {
		return nil, err
	}
	return ob, nil
}

// Options returns the outbox's options with defaults filled in.
func (ob *Outbox) Options() Options { return ob.opts }

// Message is one message to deliver to a destination.
type Message struct {
	// Destination names where the message goes; the Sender maps it to an
	// address (HTTPSender: a URL). Required.
	Destination string

	// Name tells this message apart from the effect's other messages, and
	// is part of its idempotency key: use a name that says what the message
	// is ("receipt", "welcome-email"), the same on every attempt. Letters,
	// digits, '.', '_' and '-', at most 100 bytes.
	//
	// Defaults to Destination.
	Name string

	// Payload is encoded with encoding/json, except a json.RawMessage,
	// which is sent as it is (it must be valid JSON). A plain []byte is
	// encoded as JSON's base64 string: convert JSON bytes to
	// json.RawMessage to send them unchanged.
	Payload any

	// Headers are sent with the message (HTTPSender: as HTTP headers). A
	// name or value that HTTP does not allow (a space in a name, a line
	// break in a value), a value that is not UTF-8, or two names that differ
	// only in case are refused with ErrInvalidMessage.
	Headers map[string]string

	// Key, when set, is the message's idempotency key as it is, instead of
	// one derived from the event. Use it only outside an EffectFunc: the
	// derived key is what makes retries of an effect produce the same key.
	// It is sent as an HTTP header value: at most 255 bytes (Stripe's
	// limit, and idemhttp's) of valid UTF-8 with no control character and
	// no leading or trailing space, else Enqueue fails with
	// ErrInvalidMessage.
	Key string
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,100}$`)

// Enqueue writes msg to the outbox through tx, the EffectFunc's
// transaction, so it commits exactly once with the effect and its marker and
// vanishes if they roll back. It returns the message's idempotency key.
//
// The key is derived from the event being applied (the EffectFunc's
// dedupactivity.IdempotencyKey(ctx)), the message's Name and its position
// among the effect's messages of that name: "<event key>:<name>:<n>", n
// counting from 0. Every attempt and redelivery of one event derives the
// same keys, and two events never share one. Outside an EffectFunc (in a
// plain activity, around a ClaimTx) Enqueue needs msg.Key, else it fails
// with ErrNoEventKey: only the event's claim keeps a committed attempt's
// messages from being counted again by its retry.
func (ob *Outbox) Enqueue(ctx context.Context, tx pgx.Tx, msg Message) (string, error) {
	if tx == nil {
		return "", fmt.Errorf("%w: tx is nil", ErrInvalidMessage)
	}
	if msg.Destination == "" {
		return "", fmt.Errorf("%w: Destination is empty", ErrInvalidMessage)
	}
	if !storable(msg.Destination) {
		return "", fmt.Errorf("%w: Destination %q is not valid UTF-8 without NUL", ErrInvalidMessage, msg.Destination)
	}
	if msg.Key != "" {
		if err := checkKey(msg.Key); err != nil {
			return "", fmt.Errorf("%w: %w", ErrInvalidMessage, err)
		}
	}
	if msg.Name == "" {
		msg.Name = msg.Destination
	}
	if !nameRE.MatchString(msg.Name) {
		return "", fmt.Errorf("%w: Name %q must match [A-Za-z0-9._-]{1,100}", ErrInvalidMessage, msg.Name)
	}
	payload, err := encodePayload(msg.Payload)
	if err != nil {
		return "", err
	}
	if err := checkHeaders(msg.Headers); err != nil {
		return "", fmt.Errorf("%w: %w", ErrInvalidMessage, err)
	}
	headers := msg.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	var key string
	if msg.Key != "" {
		err = tx.QueryRow(ctx, `INSERT INTO `+ob.table+` (idempotency_key, event_key, destination, name, headers, payload)
VALUES ($1, '', $2, $3, $4, $5) RETURNING idempotency_key`,
			msg.Key, msg.Destination, msg.Name, headers, payload).Scan(&key)
	} else {
		// Only the event of an EffectFunc, not any activity's identity
		// (dedupactivity.IdempotencyKey falls back to that): the position
		// counts the messages committed with this event's key, which only
		// the event's claim keeps to this transaction's own. In a plain
		// activity an attempt that committed and was retried would count its
		// own message and derive a new key.
		eventKey, ok := event.Key(ctx)
		if !ok {
			return "", ErrNoEventKey
		}
		// Earlier messages of this event with this name are visible to the
		// statement: they were written by this transaction (the event's
		// claim lets no other transaction write them).
		err = tx.QueryRow(ctx, `INSERT INTO `+ob.table+` (idempotency_key, event_key, destination, name, headers, payload)
SELECT $1 || ':' || $3 || ':' || n, $1, $2, $3, $4, $5
FROM (SELECT count(*) AS n FROM `+ob.table+` WHERE event_key = $1 AND name = $3) c
RETURNING idempotency_key`,
			eventKey, msg.Destination, msg.Name, headers, payload).Scan(&key)
	}
	if err != nil {
		return "", fmt.Errorf("outbox: enqueue: %w", translate(err))
	}
	return key, nil
}

func encodePayload(p any) ([]byte, error) {
	switch v := p.(type) {
	case json.RawMessage:
		if !json.Valid(v) {
			return nil, fmt.Errorf("%w: Payload is not valid JSON", ErrInvalidMessage)
		}
		return v, nil
	case nil:
		return []byte("null"), nil
	}
	b, err := json.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("%w: encode Payload: %w", ErrInvalidMessage, err)
	}
	return b, nil
}

// translate turns PostgreSQL errors this package knows into its own.
func translate(err error) error {
	switch sqlState(err) {
	case "42P01", "42703": // undefined_table; undefined_column: a table of an earlier migration
		return fmt.Errorf("%w: %w", ErrNotMigrated, err)
	case "23505": // unique_violation
		return fmt.Errorf("%w: %w", ErrDuplicateKey, err)
	}
	return err
}

// sqlState is err's SQLSTATE, or "" when it has none.
func sqlState(err error) string {
	var pgErr interface{ SQLState() string }
	if errors.As(err, &pgErr) {
		return pgErr.SQLState()
	}
	return ""
}

// State is a message's delivery state.
type State string

// Message states.
const (
	// StatePending: waiting for its next attempt.
	StatePending State = "pending"
	// StateSending: leased by a relay that is sending it. A lease that
	// expires (the relay died between send and acknowledgement) makes it
	// due again.
	StateSending State = "sending"
	// StateSent: the destination acknowledged it.
	StateSent State = "sent"
	// StateApplied: the reconciler found it applied at the destination.
	StateApplied State = "applied"
	// StateDead: it failed permanently or MaxAttempts times; LastError says
	// why. The reconciler may re-queue it.
	StateDead State = "dead"
	// StateRejected: the reconciler found that the destination refused it
	// for good (ErrRejected: it knows the key and gave a final answer, a
	// 3xx or 4xx over HTTP, that a resend would only replay); LastError
	// holds that answer. Nothing sends or asks about it again; Prune
	// deletes it after Retention, as a sent message.
	StateRejected State = "rejected"
)

// Stats counts the outbox's messages.
type Stats struct {
	// Pending, Sending, Sent, Applied, Dead and Rejected count the
	// messages in each State.
	Pending, Sending, Sent, Applied, Dead, Rejected int64
	// Resends is the number of leases beyond each message's first (the
	// sum of Delivery.Attempt - 1): each is a resend, or a lease that ended
	// without a send (its relay's process stopped before it reached the
	// message, or the claim made the message dead).
	Resends int64
	// OldestPendingAge is the age of the oldest pending or sending message
	// (0 when there is none).
	OldestPendingAge time.Duration
}

// Enqueued is the number of messages in the outbox.
func (s Stats) Enqueued() int64 {
	return s.Pending + s.Sending + s.Sent + s.Applied + s.Dead + s.Rejected
}

// backlogCounts is what waits in the outbox: the relay's backlog (pending,
// sending) and the dead messages left to the reconciler or a person.
type backlogCounts struct {
	pending, sending, dead int64
	oldestPendingAge       float64 // seconds
}

// backlogQuery counts the messages that wait. Its WHERE is an OR of one
// state each, not an IN list, so PostgreSQL combines the states' partial
// indexes (a BitmapOr) instead of scanning every settled message the table
// keeps for Retention (TestBacklogUsesTheStateIndexes).
func (ob *Outbox) backlogQuery() string {
	return `SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'sending'),
	count(*) FILTER (WHERE state = 'dead'),
	coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE state IN ('pending', 'sending'))), 0)::float8
FROM ` + ob.table + `
WHERE state = 'pending' OR state = 'sending' OR state = 'dead'`
}

func (ob *Outbox) backlog(ctx context.Context) (backlogCounts, error) {
	var b backlogCounts
	if err := ob.pool.QueryRow(ctx, ob.backlogQuery()).Scan(&b.pending, &b.sending, &b.dead, &b.oldestPendingAge); err != nil {
		return b, fmt.Errorf("outbox: backlog: %w", translate(err))
	}
	return b, nil
}

// Stats counts the messages by state, in one query. It reads the whole
// table, settled messages included: it is for tests, tools and occasional
// checks; the gauges New registers (MetricMessages, MetricOldestPendingAge)
// read the waiting messages through their indexes at each collection.
func (ob *Outbox) Stats(ctx context.Context) (Stats, error) {
	var s Stats
	var age float64
	err := ob.pool.QueryRow(ctx, `SELECT
	count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'sending'),
	count(*) FILTER (WHERE state = 'sent'), count(*) FILTER (WHERE state = 'applied'),
	count(*) FILTER (WHERE state = 'dead'), count(*) FILTER (WHERE state = 'rejected'),
	coalesce(sum(greatest(attempts - 1, 0)), 0),
	coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE state IN ('pending', 'sending'))), 0)::float8
FROM `+ob.table).Scan(&s.Pending, &s.Sending, &s.Sent, &s.Applied, &s.Dead, &s.Rejected, &s.Resends, &age)
	if err != nil {
		return s, fmt.Errorf("outbox: stats: %w", translate(err))
	}
	s.OldestPendingAge = time.Duration(age * float64(time.Second))
	return s, nil
}

// pruneBatchSize is how many messages one Prune statement deletes.
const pruneBatchSize = 1000

// Prune deletes sent, applied and rejected messages that settled more than
// Options.Retention ago, in batches of 1000 (each its own short
// transaction, skipping rows locked by others). Pending, sending and dead
// messages are kept. It returns how many it deleted.
func (ob *Outbox) Prune(ctx context.Context) (int64, error) {
	n, _, err := ob.prune(ctx, nil, time.Time{})
	return n, err
}

// prune is Prune, calling afterBatch (if not nil) with the running total
// after each batch. With a stopBy, it begins no batch after it, and says so
// (outOfTime).
func (ob *Outbox) prune(ctx context.Context, afterBatch func(deleted int64), stopBy time.Time) (deleted int64, outOfTime bool, err error) {
	for {
		if !stopBy.IsZero() && time.Now().After(stopBy) {
			return deleted, true, nil
		}
		tag, err := ob.pool.Exec(ctx, `DELETE FROM `+ob.table+` WHERE id = ANY (ARRAY(
	SELECT id FROM `+ob.table+` WHERE state IN ('sent', 'applied', 'rejected') AND settled_at < now() - make_interval(secs => $1)
	ORDER BY settled_at LIMIT $2 FOR UPDATE SKIP LOCKED))`, ob.opts.Retention.Seconds(), pruneBatchSize)
		if err != nil {
			return deleted, false, fmt.Errorf("outbox: prune: %w", translate(err))
		}
		deleted += tag.RowsAffected()
		if afterBatch != nil {
			afterBatch(deleted)
		}
		if tag.RowsAffected() < pruneBatchSize {
			return deleted, false, nil
		}
	}
}

// outboxColumns are the columns of the outbox table that the migration
// makes (TestOutboxColumns keeps them in step with it).
var outboxColumns = []string{"id", "idempotency_key", "event_key", "destination", "name", "headers", "payload", "state",
	"attempts", "tries", "requeues", "next_attempt_at", "lease_until", "unacked_since", "last_error", "created_at",
	"settled_at", "checked_at", "in_send", "stalls"}

// migrateLockTimeout bounds Migrate's wait for a table lock (see Migrate).
const migrateLockTimeout = 500 * time.Millisecond

var migrationFileRE = regexp.MustCompile(`^(\d{3})_([a-z0-9_]+)\.(up|down)\.sql$`)

// Migrate creates or upgrades the outbox table (and its schema). It is
// idempotent and safe to run from many processes at once: it creates the
// schema on its own, then runs in one transaction holding an advisory lock
// keyed by the table, and records applied versions in <Table>_migration.
// On an up-to-date table it only reads that record, so a role without
// CREATE (one granted SELECT on <Table>_migration and what the relay
// needs) can call it at every start. A lock on an existing table is
// waited for at most 500ms (migrateLockTimeout), so that a long
// transaction on the outbox does not hold every Enqueue behind the
// migration's lock request; the error then has SQLSTATE 55P03
// (lock_not_available): call Migrate again.
func (ob *Outbox) Migrate(ctx context.Context) error {
	names, err := fs.Glob(outbox.FS, "*.up.sql")
	if err != nil {
		return fmt.Errorf("outbox: migrate: %w", err)
	}
	sort.Strings(names)
	var want []int
	for _, n := range names {
		if m := migrationFileRE.FindStringSubmatch(n); m != nil {
			v, _ := strconv.Atoi(m[1])
			want = append(want, v)
		}
	}
	if ob.upToDate(ctx, want) {
		return nil
	}
	if err := ob.createSchema(ctx); err != nil {
		return fmt.Errorf("outbox: migrate: create schema: %w", err)
	}
	tx, err := ob.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("outbox: migrate: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) // no-op after commit
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, ob.lockKey("migrate")); err != nil {
		return fmt.Errorf("outbox: migrate: advisory lock: %w", err)
	}
	// After the advisory lock, which waits for other Migrates as long as
	// they take.
	if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", migrateLockTimeout.Milliseconds())); err != nil {
		return fmt.Errorf("outbox: migrate: lock_timeout: %w", err)
	}
	if ob.opts.Schema != "" {
		schema := pgx.Identifier{ob.opts.Schema}.Sanitize()
		if _, err := tx.Exec(ctx, `SELECT set_config('search_path', $1, true)`, schema); err != nil {
			return fmt.Errorf("outbox: migrate: search_path: %w", err)
		}
	}
	versions := pgx.Identifier{ob.opts.Table + "_migration"}.Sanitize()
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+versions+` (
	version    integer     PRIMARY KEY,
	name       text        NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return fmt.Errorf("outbox: migrate: version table: %w", err)
	}
	rows, err := tx.Query(ctx, `SELECT version FROM `+versions)
	if err != nil {
		return fmt.Errorf("outbox: migrate: read versions: %w", err)
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return fmt.Errorf("outbox: migrate: read versions: %w", err)
	}
	// The table in current_schema() (Options.Schema, set above), where the
	// files make it, not one of that name further down search_path; and
	// the outbox columns it lacks: a table of that name made by something
	// else, which CREATE TABLE IF NOT EXISTS would leave as it is, and
	// every Enqueue then fail on.
	var tableThere bool
	var missing []string
	if err := tx.QueryRow(ctx, `SELECT c.oid IS NOT NULL, coalesce((SELECT array_agg(col) FROM unnest($2::text[]) AS col
	WHERE NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = c.oid AND attname = col AND NOT attisdropped)), '{}')
FROM (SELECT to_regclass(format('%I.%I', current_schema(), $1::text)) AS oid) AS c`, ob.opts.Table, outboxColumns).Scan(&tableThere, &missing); err != nil {
		return fmt.Errorf("outbox: migrate: look for the table: %w", err)
	}
	if tableThere && len(missing) > 0 {
		return fmt.Errorf("%w: the table %s exists without the column(s) %s of an outbox: it was not made by this package; give Options another Table (or Schema), or drop it", ErrInvalidConfig, ob.opts.Table, strings.Join(missing, ", "))
	}
	applied := map[int]bool{}
	for _, v := range done {
		// A table dropped by hand, its record left: the files, idempotent,
		// make it again.
		applied[v] = tableThere
	}
	for _, n := range names {
		m := migrationFileRE.FindStringSubmatch(n)
		if m == nil {
			continue
		}
		v, _ := strconv.Atoi(m[1])
		if applied[v] {
			continue
		}
		body, err := fs.ReadFile(outbox.FS, n)
		if err != nil {
			return fmt.Errorf("outbox: migrate: read %s: %w", n, err)
		}
		sql := strings.ReplaceAll(string(body), outbox.TableToken, ob.opts.Table)
		if _, err := tx.Exec(ctx, sql); err != nil {
			if sqlState(err) == "55P03" { // lock_not_available
				return fmt.Errorf("outbox: migrate: apply %s: a transaction held the table for longer than %s (retry): %w", n, migrateLockTimeout, err)
			}
			return fmt.Errorf("outbox: migrate: apply %s: %w", n, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+versions+` (version, name) VALUES ($1, $2) ON CONFLICT (version) DO NOTHING`, v, m[2]); err != nil {
			return fmt.Errorf("outbox: migrate: record %s: %w", n, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("outbox: migrate: commit: %w", err)
	}
	return nil
}

// upToDate says whether <Table>_migration records every version in want,
// reading only: CREATE TABLE IF NOT EXISTS and CREATE SCHEMA IF NOT EXISTS
// check the CREATE privilege before they look. Any error (no such table,
// no SELECT on it) is a no: the full migration then runs, and says what
// failed.
func (ob *Outbox) upToDate(ctx context.Context, want []int) bool {
	name := pgx.Identifier{ob.opts.Table + "_migration"}
	if ob.opts.Schema != "" {
		name = pgx.Identifier{ob.opts.Schema, ob.opts.Table + "_migration"}
	}
	// Both tables, in Options.Schema or else current_schema(), where the
	// files make them (not ones of those names further down search_path,
	// another application's): one dropped by hand, its record left, is
	// made again, and one without an outbox's columns is refused. No
	// current_schema() (NULL) is an error, hence a no.
	var there bool
	if err := ob.pool.QueryRow(ctx, `SELECT to_regclass(format('%I.%I', s, $2::text)) IS NOT NULL AND
	(SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass(format('%I.%I', s, $3::text)) AND attname = ANY($4::text[]) AND NOT attisdropped) = cardinality($4::text[])
FROM (SELECT coalesce(nullif($1::text, ''), current_schema()) AS s) AS c`, ob.opts.Schema, ob.opts.Table+"_migration", ob.opts.Table, outboxColumns).Scan(&there); err != nil || !there {
		return false
	}
	var n int
	err := ob.pool.QueryRow(ctx, `SELECT count(DISTINCT version) FROM `+name.Sanitize()+` WHERE version = ANY($1)`, want).Scan(&n)
	return err == nil && n == len(want)
}

// createSchema creates Options.Schema (if set) unless it exists, in a
// statement of its own before the migration's transaction, as
// dedupactivity's Deduper.Migrate does (see pgschema.Ensure).
func (ob *Outbox) createSchema(ctx context.Context) error {
	if ob.opts.Schema == "" {
		return nil
	}
	return pgschema.Ensure(ctx, ob.pool, ob.opts.Schema)
}

func (ob *Outbox) lockKey(purpose string) int64 {
	h := fnv.New64a()
	h.Write([]byte("dedupactivity.outbox." + purpose + ":" + ob.table))
	return int64(h.Sum64())
}
