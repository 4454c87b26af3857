package dedupactivity

// This file is the one home of the SQL that touches the marker table and of
// the translation of PostgreSQL errors into this package's errors. claim.go
// drives the protocol with these statements; migrate.go, prune.go and
// partition.go run the rest.

import (
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// SQLSTATEs this package names.
const (
	stateUndefinedTable   = "42P01"
	stateUndefinedFunc    = "42883" // only this package's functions can be missing in its statements
	stateUndefinedColumn  = "42703"
	stateLockNotAvailable = "55P03" // lock_timeout expired
	stateQueryCanceled    = "57014" // statement_timeout (or a cancel request)
	stateReadOnlySQLTx    = "25006" // default_transaction_read_only, or a standby
	stateDuplicateTable   = "42P07"
	stateCheckViolation   = "23514"
	stateUniqueViolation  = "23505"
	stateTxEnded          = "DDUP2" // raised by the <table>_ended function
	stateTableMoved       = "DDUP3" // raised by the <table>_moved function
	// A partition bound overlapping another partition's, among others.
	stateInvalidObjectDefinition = "42P17"
	stateInsufficientPrivilege   = "42501"
)

// store holds the marker table's statements, with the table name filled in
// once, and runs the protocol's round trips on a connection.
//
// The statements that run after the effect (insertLast, complete) are given
// the table's OID as the claim's first statement (look or insert) found it,
// and fail with SQLSTATE DDUP3, from the <table>_moved function, when the
// name now resolves to another table. Without a Schema the name is
// unqualified, and an effect that changed search_path would otherwise have
// the marker, or its result, written to another schema's marker table,
// where the next delivery does not look: the event could be applied twice.
type store struct {
	table       string // quoted and schema-qualified
	partitioned bool

	// insert claims the event in one statement: it sets the claim's
	// lock_timeout (saving the transaction's own in a custom setting, the
	// two calls in that order as the operands of ||) in its WHERE clause,
	// so before the insert can wait; inserts the marker
	// with ON CONFLICT DO NOTHING, which waits for a concurrent transaction
	// that inserted the same key (if that one commits, this one inserts
	// nothing: a duplicate; if it rolls back, this one inserts); and in
	// RETURNING, evaluated only for an inserted row, puts the saved
	// lock_timeout back and returns the new row's ctid, the top-level
	// transaction's ID, the table's OID and the row's xmin (in a savepoint,
	// the savepoint's own transaction ID; '' in the partitioned layout).
	// When nothing is inserted the claim's lock_timeout stays until the
	// transaction ends: restoreLockTimeout puts it back for a caller that
	// goes on.
	insert             *stmt
	restoreLockTimeout string
	// insertLast inserts the whole marker, result included, just before
	// COMMIT, for a claim that went as a look (see claimTx). It sets the
	// claim wait as lock_timeout in its WHERE clause, before it can wait for
	// a concurrent transaction that inserted the same key; if that one
	// commits, the insert fails (unique_violation): a duplicate, and the
	// COMMIT behind it commits nothing. Nothing follows but COMMIT, so the
	// lock_timeout is not put back. It inserts only into the table the look
	// read (see store).
	insertLast *stmt
	// customPlans makes the rest of the transaction plan its statements
	// for their parameters (partitioned layout, before complete): a generic
	// plan of the UPDATE locks every partition, so a claim's result update
	// would wait for a pruner that holds an expired partition's lock while
	// the claim holds the table's, which the pruner's detach then waits
	// for. Planned for its parameters, it locks its marker's partition
	// alone.
	customPlans *stmt
	// lookPlans has the look that follows it planned for its parameters
	// (partitioned layout), saving the transaction's plan_cache_mode in a
	// custom setting, which the look puts back: a generic plan of the look
	// locks every partition, the default one included, until the
	// transaction ends, so a first attempt whose effect ran longer than
	// the pruner's lock timeout kept a partition ahead from being attached
	// (its ACCESS EXCLUSIVE lock on the default partition), with the
	// claims behind the attach's lock request. Planned for its parameters,
	// the look locks its marker's partition alone. The effect's statements
	// are planned as the session plans them.
	lookPlans *stmt
	// complete stores the result in the marker, found by its ctid and
	// checked by its key (the claim may have been rolled back to a
	// savepoint, and its ctid given to another event's marker since),
	// after checking, as guard does, that the transaction is still the
	// claim's, and that the table is (see store). The checks are an
	// uncorrelated subquery, so a one-time filter that runs whether or not
	// the marker row is found.
	complete *stmt
	// guard fails (SQLSTATE DDUP2, from the <table>_ended function) when the
	// top-level transaction is no longer the claim's: the effect ended it
	// and began another. Queued before COMMIT, it keeps that COMMIT from
	// committing anything.
	guard *stmt
	// read returns a committed marker.
	read *stmt
	// look is read for a claim that goes as a look (see claimTx): one row,
	// saying whether a marker is committed (a duplicate reads it with its
	// rollback, as any duplicate), whether the transaction is read-only
	// (the marker goes in at COMMIT, after the effect's writes have failed
	// on that), and the table's OID.
	look *stmt
	// self is the OID of the table its name finds now.
	self *stmt
	// exists says whether a marker is committed.
	exists string
	// result returns a committed marker's result, found by id_hash alone
	// (one event has one ScheduledTime, so one partition).
	result string
	// oldest reads two ages in seconds: of the marker that expires first,
	// and how long past its expiry it waits for Prune (0 when it has not
	// expired). In the plain layout it reads that marker through the
	// expiry index (no row when the table is empty). In the partitioned
	// layout, whose range partitions have none, it reads the catalog and
	// the default partition's index: the age of the oldest range
	// partition's start or of the default partition's first-expiring
	// marker, whichever is older; and how long ago the default
	// partition's first marker expired or the oldest range partition's
	// end plus Retention passed (when its markers expire, for deliveries
	// claimed in their range), whichever is longer.
	oldest string
	// oldestRanges is oldest of the range partitions alone (partitioned
	// layout), for a role that may not read the default partition.
	oldestRanges string
	// inDefault says whether the default partition holds a marker of the
	// range [$1, $2) (partitioned layout).
	inDefault string
	// prune deletes up to $1 expired markers, found by their ctid (in the
	// partitioned layout id_hash alone is not unique), skipping rows locked
	// by a concurrent pruner.
	prune string

	// stmts are the statements a claim may send on its connection (see
	// wire.go), prepared there together before its first round trip.
	stmts []*stmt
}

func newStore(table, ended, moved string, partitioned bool, defaultPartition string, retention time.Duration) *store {
	keyCol, keyVal, completeCond, keyCond, pruned := ``, ``, ``, ``, table
	// The inserted row's xmin, for ClaimTx (see connState.claimOpen); a
	// partitioned table's RETURNING cannot give a system column, and
	// ClaimTx refuses that layout.
	xmin := `xmin::text`
	lastOID, completeOID, completeKey := `$8`, `$4`, `$5` // the parameters of the claim's table OID, and of complete's key
	if partitioned {
		keyCol, keyVal, pruned, xmin = `, scheduled_at`, `, $8::timestamptz`, defaultPartition, `''`
		completeCond, keyCond = ` AND scheduled_at = $4`, ` AND scheduled_at = $2`
		lastOID, completeOID, completeKey = `$9`, `$5`, `$6`
	}
	// self is the OID of the table the name resolves to, under the
	// statement's search_path (a prepared statement is planned again when
	// search_path changes). Table names hold no quote.
	self := `'` + table + `'::regclass::oid`
	// The parameters of a marker (see markerParams) and of its key.
	marker := []uint32{oidBytea, oidInt4, oidTimestamptz, oidText, oidBytea, oidBytea, oidText}
	key := []uint32{oidBytea}
	completeParams := []uint32{oidTID, oidBytea, oidText}
	if partitioned {
		marker = append(marker, oidTimestamptz)
		key = append(key, oidTimestamptz)
		completeParams = append(completeParams, oidTimestamptz)
	}
	st := &store{
		table:       table,
		partitioned: partitioned,
		insert: newStmt(`INSERT INTO `+table+` (id_hash, attempt, expires_at, activity_type, fingerprint, result`+keyCol+`)
SELECT $1::bytea, $2::int4, $3::timestamptz, $4::text, $5::bytea, $6::bytea`+keyVal+`
WHERE (set_config('dedupactivity.lock_timeout', current_setting('lock_timeout'), true) || set_config('lock_timeout', $7, true)) IS NOT NULL
ON CONFLICT DO NOTHING
RETURNING ctid, pg_current_xact_id()::text, set_config('lock_timeout', current_setting('dedupactivity.lock_timeout'), true), `+self+`, `+xmin, marker...),
		insertLast: newStmt(`INSERT INTO `+table+` (id_hash, attempt, expires_at, activity_type, fingerprint, result`+keyCol+`)
SELECT $1::bytea, $2::int4, $3::timestamptz, $4::text, $5::bytea, $6::bytea`+keyVal+`
WHERE set_config('lock_timeout', $7, true) IS NOT NULL AND CASE WHEN `+self+` = `+lastOID+`::oid THEN true ELSE `+moved+`() END`, slices.Concat(marker, []uint32{oidOID})...),
		restoreLockTimeout: `SELECT set_config('lock_timeout', current_setting('dedupactivity.lock_timeout'), true)`,
		complete: newStmt(`UPDATE `+table+` SET result = $2 WHERE ctid = $1`+completeCond+` AND id_hash = `+completeKey+` AND (SELECT CASE
	WHEN pg_current_xact_id() <> $3::text::xid8 THEN `+ended+`()
	WHEN `+self+` <> `+completeOID+`::oid THEN `+moved+`()
	ELSE true END)`, slices.Concat(completeParams, []uint32{oidOID, oidBytea})...),
		guard: newStmt(`SELECT CASE WHEN pg_current_xact_id() = $1::text::xid8 THEN true ELSE `+ended+`() END`, oidText),
		// bytea read as hex text: pgx decodes bytea text only in the hex
		// output format, and ClaimTx's statements on a connection of pgx's
		// simple protocol read text whatever bytea_output says.
		read:      newStmt(`SELECT encode(fingerprint, 'hex'), encode(result, 'hex'), attempt, xmin::text, activity_type FROM `+table+` WHERE id_hash = $1`+keyCond, key...),
		look:      newStmt(`SELECT EXISTS (SELECT FROM `+table+` WHERE id_hash = $1`+keyCond+`), current_setting('transaction_read_only') = 'on', `+self, key...),
		self:      newStmt(`SELECT ` + self),
		exists:    `SELECT EXISTS (SELECT 1 FROM ` + table + ` WHERE id_hash = $1)`,
		result:    `SELECT encode(result, 'hex') FROM ` + table + ` WHERE id_hash = $1 LIMIT 1`,
		oldest:    `SELECT extract(epoch FROM now() - claimed_at)::float8, greatest(extract(epoch FROM now() - expires_at), 0)::float8 FROM ` + table + ` ORDER BY expires_at LIMIT 1`,
		inDefault: `SELECT EXISTS (SELECT 1 FROM ` + defaultPartition + ` WHERE scheduled_at >= $1 AND scheduled_at < $2)`,
		prune: `DELETE FROM ` + pruned + ` WHERE ctid = ANY (ARRAY(
	SELECT ctid FROM ` + pruned + ` WHERE expires_at < now()
	LIMIT $1 FOR UPDATE SKIP LOCKED))`,
	}
	if partitioned {
		// A partition holds markers claimed from its start on, and is
		// dropped once its range is over and they have expired: past
		// Retention plus its width plus the prune interval, pruning is
		// not keeping up. Bounds are deparsed without the relation (see
		// listPartitionsSQL), so no partition's lock is waited for.
		bound := func(which string) string {
			return `SELECT min(substring(pg_get_expr(c.relpartbound, 0) FROM $$` + which + ` \('([^']+)'\)$$)::timestamptz)
	FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = ` + self
		}
		// The oldest range partition's markers, of deliveries claimed in
		// its range, expire by its end plus Retention; a partition that
		// holds a delivery claimed later (a retry long after its
		// scheduling) is kept that much longer, and counts as overdue
		// meanwhile.
		rangesOverdue := `extract(epoch FROM now() - interval '` + strconv.FormatInt(int64(retention/time.Second), 10) + ` seconds' - (` + bound("TO") + `))`
		st.oldest = `SELECT extract(epoch FROM now() - least(
	(SELECT claimed_at FROM ` + defaultPartition + ` ORDER BY expires_at LIMIT 1),
	(` + bound("FROM") + `)))::float8,
	greatest(0, extract(epoch FROM now() - (SELECT expires_at FROM ` + defaultPartition + ` ORDER BY expires_at LIMIT 1)), ` + rangesOverdue + `)::float8`
		st.oldestRanges = `SELECT extract(epoch FROM now() - (` + bound("FROM") + `))::float8, greatest(0, ` + rangesOverdue + `)::float8`
	}
	st.stmts = []*stmt{beginStmt, commitStmt, rollbackStmt, st.look, st.insert, st.insertLast, st.complete, st.guard, st.read, st.self}
	if partitioned {
		st.customPlans = newStmt(`SELECT set_config('plan_cache_mode', 'force_custom_plan', true)`)
		st.lookPlans = newStmt(`SELECT set_config('dedupactivity.plan_cache_mode', current_setting('plan_cache_mode'), true) || set_config('plan_cache_mode', 'force_custom_plan', true)`)
		// The look puts the saved plan_cache_mode back as it runs: its own
		// plan was chosen when it was bound, before.
		st.look = newStmt(`SELECT EXISTS (SELECT FROM `+table+` WHERE id_hash = $1`+keyCond+`), current_setting('transaction_read_only') = 'on', `+self+`, set_config('plan_cache_mode', current_setting('dedupactivity.plan_cache_mode'), true)`, key...)
		st.stmts = []*stmt{beginStmt, commitStmt, rollbackStmt, st.lookPlans, st.look, st.insert, st.insertLast, st.complete, st.guard, st.read, st.self, st.customPlans}
	}
	return st
}

// Migrations (migrate.go).
const (
	// catalogSQL lists which of the columns $2 the table $1 lacks (all of
	// them when there is no table $1), says whether the version table $3
	// exists and can be read, whether every function $4 exists, whether $1
	// is a partitioned table (NULL when there is no table $1), and whether
	// it is in current_schema() (where the files create an unqualified
	// table).
	catalogSQL = `SELECT
	(SELECT coalesce(array_agg(c ORDER BY c), '{}') FROM unnest($2::text[]) AS c
		WHERE NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = c AND NOT attisdropped)),
	(SELECT coalesce(has_table_privilege(to_regclass($3), 'SELECT'), false)),
	(SELECT bool_and(to_regprocedure(f) IS NOT NULL) FROM unnest($4::text[]) AS f),
	(SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)),
	(SELECT coalesce(relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()), false) FROM pg_class WHERE oid = to_regclass($1))`
	// layoutSQL says whether the table named $1 in current_schema(), where
	// the files make it, is partitioned (no row when there is none).
	layoutSQL           = `SELECT relkind = 'p' FROM pg_class WHERE relname = $1 AND relnamespace = current_schema()::regnamespace`
	advisoryXactLockSQL = `SELECT pg_advisory_xact_lock($1)`
	// currentXactSQL is the transaction's ID, or NULL if it has written
	// nothing.
	currentXactSQL        = `SELECT pg_current_xact_id_if_assigned()::text`
	setLocalSearchPathSQL = `SELECT set_config('search_path', $1, true)`
)

func createVersionTableSQL(table string) string {
	return `CREATE TABLE IF NOT EXISTS ` + table + ` (
	version    integer     PRIMARY KEY,
	name       text        NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now())`
}

func maxVersionSQL(table string) string { return `SELECT max(version) FROM ` + table }

func recordVersionSQL(table string) string {
	return `INSERT INTO ` + table + ` (version, name) VALUES ($1, $2) ON CONFLICT (version) DO NOTHING`
}

// Partition maintenance (partition.go).
const (
	// listPartitionsSQL lists the partitions of $1 with their bounds in
	// Unix seconds (NULL for the default partition), read back from the
	// bound's text in the session's own TimeZone, under the ISO DateStyle
	// (setLocalISODateStyleSQL), which prints the offset: the others print
	// the zone's abbreviation, which PostgreSQL reads by its own list, as
	// another zone's (Dublin's summer IST as Israel's) or not at all
	// (Jakarta's WIB). The bound is deparsed without its relation (0): it
	// holds constants only, and given the relation pg_get_expr would wait
	// for its lock, so the list would wait for a pruner's drop, or a long
	// reader, of any partition.
	listPartitionsSQL = `SELECT c.relname,
	extract(epoch FROM substring(b.expr FROM $$FROM \('([^']+)'\)$$)::timestamptz)::float8,
	extract(epoch FROM substring(b.expr FROM $$TO \('([^']+)'\)$$)::timestamptz)::float8
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid,
	LATERAL (SELECT pg_get_expr(c.relpartbound, 0) AS expr) b
WHERE i.inhparent = $1::regclass`
	setLocalLockTimeoutSQL  = `SELECT set_config('lock_timeout', $1, true)`
	setLocalISODateStyleSQL = `SELECT set_config('DateStyle', 'ISO', true)`
)

// createPartition makes the range partition name for [lo, hi).
func (s *store) createPartition(name string, lo, hi time.Time) string {
	return fmt.Sprintf(`CREATE TABLE %s PARTITION OF %s FOR VALUES FROM (%s) TO (%s) WITH (fillfactor = 80)`,
		name, s.table, timeLiteral(lo), timeLiteral(hi))
}

// attachPartition makes the range partition name for [lo, hi) as a table
// of its own, then attaches it (see attachAhead). The attach builds the
// table's primary key index, on no rows, and reads the default partition
// for rows of the range under that partition's lock (which claims routed
// there hold: see attachAhead).
func (s *store) attachPartition(name string, lo, hi time.Time) []string {
	return []string{
		// The attach's lock on the table first: it conflicts with itself,
		// not with claims, so a second worker making the same partition
		// waits here and then finds it (42P07), instead of failing on the
		// first one's catalog row (23505) as its CREATE TABLE would. ONLY:
		// the table alone, as the attach locks it, not its partitions.
		`LOCK TABLE ONLY ` + s.table + ` IN SHARE UPDATE EXCLUSIVE MODE`,
		`CREATE TABLE ` + name + ` (LIKE ` + s.table + ` INCLUDING DEFAULTS) WITH (fillfactor = 80)`,
		fmt.Sprintf(`ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM (%s) TO (%s)`, s.table, name, timeLiteral(lo), timeLiteral(hi)),
	}
}

// lockPartitionSQL takes a partition's lock against writes (EXCLUSIVE
// MODE): readers go on, and claims of other ranges take no lock on it.
func lockPartitionSQL(name string) string { return `LOCK TABLE ` + name + ` IN EXCLUSIVE MODE` }

func (s *store) detachPartition(name string) string {
	return `ALTER TABLE ` + s.table + ` DETACH PARTITION ` + name
}

// anyLiveSQL says whether a partition holds a marker that has not expired;
// it stops at the first.
func anyLiveSQL(name string) string {
	return `SELECT EXISTS (SELECT 1 FROM ` + name + ` WHERE expires_at >= now())`
}

// countLiveSQL counts a partition's markers and says whether any has not
// expired.
func countLiveSQL(name string) string {
	return `SELECT count(*), coalesce(max(expires_at) >= now(), false) FROM ` + name
}

func dropTableSQL(name string) string { return `DROP TABLE ` + name }

// timeLiteral is a timestamptz literal for DDL, which takes no parameters;
// RFC 3339 text holds only digits and "-:.TZ", and is read the same under
// any DateStyle. Truncated to microseconds, as PostgreSQL stores it.
func timeLiteral(t time.Time) string {
	return "'" + t.UTC().Truncate(time.Microsecond).Format(time.RFC3339Nano) + "'::timestamptz"
}

// marker is the row the claim inserts. One is made for each attempt and
// never reused: the effect's context points at its sum (event.With).
type marker struct {
	sum          [32]byte // SHA-256 of the identity's encoding: the key
	attempt      int32
	expiresAt    time.Time
	activityType string
	fingerprint  []byte // nil: not compared
	result       []byte // nil, or empty when results are discarded
	scheduledAt  time.Time
	heartbeat    time.Duration // the activity's HeartbeatTimeout (see Deduper.claimWaitFor)
	ctid         pgtype.TID    // of the inserted row, once claimed
	xact         string        // the claim's top-level transaction ID, once claimed
	xmin         string        // the inserted row's xmin (a savepoint's own ID in one), once claimed
	table        uint32        // the marker table's OID, as the claim's first statement found it
}

// addClaim queues the claim of m on t; claimed reads it.
func (s *store) addClaim(t *trip, m *marker, wait time.Duration) {
	s.markerParams(t, m, wait)
	t.add(s.insert)
}

// addInsertLast queues the insert of the whole marker m, for COMMIT, into
// the table the look read.
func (s *store) addInsertLast(t *trip, m *marker, wait time.Duration) {
	s.markerParams(t, m, wait)
	t.oid(m.table)
	t.add(s.insertLast)
}

// appendLockTimeout appends d as a lock_timeout setting in whole
// milliseconds, such as "250ms". d must be at least a millisecond (see
// Deduper.claimWaitFor): a lock_timeout of 0 waits for ever.
func appendLockTimeout(b []byte, d time.Duration) []byte {
	return append(strconv.AppendInt(b, d.Milliseconds(), 10), "ms"...)
}

// markerParams are the parameters of insert and insertLast: the marker, the
// claim wait as a lock_timeout, and (partitioned) its scheduled time.
func (s *store) markerParams(t *trip, m *marker, wait time.Duration) {
	t.bytea(m.sum[:]).int4(m.attempt).timestamptz(m.expiresAt).text(m.activityType).bytea(m.fingerprint).bytea(m.result).
		lockTimeout(wait)
	s.scheduledAt(t, m)
}

// scheduledAt appends m's scheduled time, the rest of its key in the
// partitioned layout.
func (s *store) scheduledAt(t *trip, m *marker) {
	if s.partitioned {
		t.timestamptz(m.scheduledAt)
	}
}

// insertedBy says whether xmin (a marker's, as text) is the transaction that
// claimed m: the 32 low bits of the claim's xid8.
func (m *marker) insertedBy(xmin string) bool { return sameXact(m.xact, xmin) }

// sameXact says whether the transaction xact (a full xid8, as text) is the
// one whose 32-bit xid is xmin (a row's xmin, as text).
func sameXact(xact, xmin string) bool {
	x, err1 := strconv.ParseUint(xact, 10, 64)
	y, err2 := strconv.ParseUint(xmin, 10, 32)
	return err1 == nil && err2 == nil && uint32(x) == uint32(y)
}

// claimed reads what addClaim queued. It is false when the marker was
// already committed (a duplicate); when true, m.ctid and m.xact are the new
// row's and its transaction's, and m.table its table's. A key inserted into
// another table than the look read (the effect changed search_path between
// the two) is ErrSearchPathChanged. The connection then remembers the
// claim as open (see connState.claimOpen).
func (s *store) claimed(t *trip, m *marker) (bool, error) {
	var ctid pgtype.TID
	var xact, xmin string
	var table uint32
	found, err := t.row(func(cols [][]byte) (err error) {
		if ctid, err = colTID(cols[0]); err != nil {
			return err
		}
		xact = string(cols[1])
		if table, err = colUint32(cols[3]); err != nil {
			return err
		}
		xmin = string(cols[4])
		return nil
	})
	if err != nil || !found {
		return false, err
	}
	if err := m.claimedAs(ctid, xact, table, xmin); err != nil {
		return false, err
	}
	t.s.claimOpen(m.sum, xact, xmin) // so that a ClaimTx of the event in the effect is refused
	return true, nil
}

// claimedAs records the row the claim inserted: its ctid, its transaction,
// its xmin, and its table, which must be the one the look read (if any).
func (m *marker) claimedAs(ctid pgtype.TID, xact string, table uint32, xmin string) error {
	if m.table != 0 && table != m.table {
		return fmt.Errorf("%w: the marker's key went to table OID %d, the look read %d", ErrSearchPathChanged, table, m.table)
	}
	m.ctid, m.xact, m.table, m.xmin = ctid, xact, table, xmin
	return nil
}

// addComplete queues the result update (or, when results are discarded,
// only the guard); completed reports whether the update found the marker.
func (s *store) addComplete(t *trip, m *marker, storeResult bool) {
	if !storeResult {
		t.text(m.xact)
		t.add(s.guard)
		return
	}
	if s.customPlans != nil {
		t.add(s.customPlans)
	}
	t.tid(m.ctid).bytea(m.result).text(m.xact)
	s.scheduledAt(t, m)
	t.oid(m.table).bytea(m.sum[:])
	t.add(s.complete)
}

// completed reads what addComplete queued.
func (s *store) completed(t *trip, storeResult bool) (bool, error) {
	if s.customPlans != nil && storeResult {
		if _, err := t.exec(); err != nil {
			return false, err
		}
	}
	tag, err := t.exec()
	return tag.RowsAffected() == 1, err
}

// stored is a committed marker, as a duplicate delivery reads it.
type stored struct {
	fingerprint  []byte
	result       []byte
	attempt      int32
	xmin         string // the transaction that inserted it
	activityType string
}

// addRead queues the read of m's committed marker; readStored reads it.
func (s *store) addRead(t *trip, m *marker) {
	t.bytea(m.sum[:])
	s.scheduledAt(t, m)
	t.add(s.read)
}

func readStored(t *trip) (st stored, found bool, err error) {
	found, err = t.row(func(cols [][]byte) error {
		attempt, err := colUint32(cols[2])
		if err == nil {
			st, err = storedFrom(cols[0], cols[1], int32(attempt), string(cols[3]), string(cols[4]))
		}
		return err
	})
	return st, found && err == nil, err
}

// storedFrom is a committed marker from its columns as read, fingerprint
// and result in hex (nil: NULL).
func storedFrom(fingerprint, result []byte, attempt int32, xmin, activityType string) (st stored, err error) {
	st.attempt, st.xmin, st.activityType = attempt, xmin, activityType
	if st.fingerprint, err = decodeHex(fingerprint); err != nil {
		return st, err
	}
	st.result, err = decodeHex(result)
	return st, err
}

// decodeHex decodes a hex column; NULL stays nil, and an empty string becomes empty
// (not nil): a discarded result.
func decodeHex(s []byte) ([]byte, error) {
	if s == nil {
		return nil, nil
	}
	b := make([]byte, hex.DecodedLen(len(s)))
	if _, err := hex.Decode(b, s); err != nil {
		return nil, fmt.Errorf("dedupactivity: read marker: %w", err)
	}
	return b, nil
}

// addLook queues the look for m's committed marker (in the partitioned
// layout after lookPlans); looked reads it, and the table's OID into
// m.table. A read-only transaction is ErrReadOnly.
func (s *store) addLook(t *trip, m *marker) {
	if s.lookPlans != nil {
		t.add(s.lookPlans)
	}
	t.bytea(m.sum[:])
	s.scheduledAt(t, m)
	t.add(s.look)
}

func (s *store) looked(t *trip, m *marker) (found bool, err error) {
	if s.lookPlans != nil {
		if _, err := t.exec(); err != nil {
			return false, err
		}
	}
	var readOnly bool
	got, err := t.row(func(cols [][]byte) (err error) {
		if found, err = colBool(cols[0]); err != nil {
			return err
		}
		if readOnly, err = colBool(cols[1]); err != nil {
			return err
		}
		m.table, err = colUint32(cols[2])
		return err
	})
	switch {
	case err != nil:
		return false, err
	case !got:
		return false, errors.New("dedupactivity: the look returned no row")
	case readOnly:
		return false, fmt.Errorf("%w (transaction_read_only is on)", ErrReadOnly)
	}
	return found, nil
}

// ClaimTx sends its statements through the caller's pgx.Tx, as pgx
// batches, so they go where the caller's transaction is (or fail with
// pgx.ErrTxClosed once it ended).

// queueClaim queues the claim on b; readClaim reads it (see claimed).
func (s *store) queueClaim(b *pgx.Batch, m *marker, wait time.Duration) {
	b.Queue(s.insert.sql, m.sum[:], m.attempt, m.expiresAt, m.activityType, m.fingerprint, m.result, string(appendLockTimeout(nil, wait)))
}

func (s *store) readClaim(br pgx.BatchResults, m *marker) (bool, error) {
	var ctid pgtype.TID
	var xact, xmin string
	var table uint32
	err := br.QueryRow().Scan(&ctid, &xact, nil, &table, &xmin)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return true, m.claimedAs(ctid, xact, table, xmin)
}

// queueRead queues the read of m's committed marker; scanStored reads it.
func (s *store) queueRead(b *pgx.Batch, m *marker) { b.Queue(s.read.sql, m.sum[:]) }

func scanStored(br pgx.BatchResults) (st stored, found bool, err error) {
	var fingerprint, result *string
	var attempt int32
	var xmin, activityType string
	err = br.QueryRow().Scan(&fingerprint, &result, &attempt, &xmin, &activityType)
	if errors.Is(err, pgx.ErrNoRows) {
		return st, false, nil
	}
	if err != nil {
		return st, false, err
	}
	bytesOf := func(s *string) []byte {
		if s == nil {
			return nil
		}
		return []byte(*s)
	}
	st, err = storedFrom(bytesOf(fingerprint), bytesOf(result), attempt, xmin, activityType)
	return st, err == nil, err
}

// queueComplete queues the result update (or, when results are discarded,
// only the guard); readComplete reports whether the update found the
// marker.
func (s *store) queueComplete(b *pgx.Batch, m *marker, storeResult bool) {
	if !storeResult {
		b.Queue(s.guard.sql, m.xact)
		return
	}
	b.Queue(s.complete.sql, m.ctid, m.result, m.xact, m.table, m.sum[:])
}

func readComplete(br pgx.BatchResults) (bool, error) {
	tag, err := br.Exec()
	return tag.RowsAffected() == 1, err
}

// interpretError turns PostgreSQL errors this package knows into its own
// sentinels, keeping the original in the chain. inClaim says the error came
// from the claim's statements, where a cancelled statement means the claim's
// wait ran into statement_timeout.
func interpretError(err error, inClaim bool) error {
	switch state := sqlState(err); {
	case state == stateUndefinedTable, state == stateUndefinedFunc, state == stateUndefinedColumn:
		// A marker statement's column missing: a table of that name that
		// Migrate did not make (it refuses such a table).
		return fmt.Errorf("%w: %w", ErrNotMigrated, err)
	case state == stateLockNotAvailable && inClaim:
		return fmt.Errorf("%w: %w", ErrClaimTimeout, err)
	case state == stateQueryCanceled && inClaim:
		return fmt.Errorf("%w (statement_timeout is shorter than the claim wait): %w", ErrClaimTimeout, err)
	case state == stateReadOnlySQLTx:
		return fmt.Errorf("%w: %w", ErrReadOnly, err)
	case state == stateTxEnded:
		return fmt.Errorf("%w: %w", ErrTxEnded, err)
	case state == stateTableMoved:
		return fmt.Errorf("%w: %w", ErrSearchPathChanged, err)
	}
	return err
}

// validText makes s storable as text: bytes that are not valid UTF-8, and
// NUL, which text cannot hold, become U+FFFD.
func validText(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

func sqlState(err error) string {
	if err == nil {
		return "" // before pgErr, which escapes
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}
