package dedupactivity

// This file sends the claim's round trips: the claim's own statements (in
// store.go) and the effect's first statement when it rides with them. Each
// round trip is one pgconn batch, written at once and read in order, with the
// parameters of the claim's statements encoded in binary here. pgx's own
// batches keep per-statement bookkeeping (a pipeline's request queues, the
// queued arguments boxed as values) that costs about as much client CPU as
// the statements themselves; see "What it costs" in docs/design.md.
//
// On a connection that caches statements (pgx's default,
// QueryExecModeCacheStatement) the statements are prepared by name once per
// connection, the effect's riding statements too; on any other connection
// they are sent unnamed, parsed each time, so nothing is left prepared on a
// server connection a pooler may hand to another client, and no statement
// rides.

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel/trace"
)

// stmt is one of the claim's statements: its SQL, the types of its
// parameters (sent in binary, in this order) and its prepared name.
type stmt struct {
	sql    string
	params []uint32
	name   string
}

// Parameter types of the claim's statements.
const (
	oidBytea       = pgtype.ByteaOID
	oidInt4        = pgtype.Int4OID
	oidText        = pgtype.TextOID
	oidOID         = pgtype.OIDOID
	oidTID         = pgtype.TIDOID
	oidTimestamptz = pgtype.TimestamptzOID
)

func newStmt(sql string, params ...uint32) *stmt {
	sum := sha256.Sum256([]byte(sql))
	return &stmt{sql: sql, params: params, name: "dedupactivity_" + hex.EncodeToString(sum[:12])}
}

// Transaction control, prepared like the rest.
var (
	beginStmt    = newStmt(`BEGIN ISOLATION LEVEL READ COMMITTED`)
	commitStmt   = newStmt(`COMMIT`)
	rollbackStmt = newStmt(`ROLLBACK`)
)

// binaryFormat asks for every parameter, or every result column, in binary.
var binaryFormat = []int16{pgtype.BinaryFormatCode}

// maxStmts bounds the statements this package keeps prepared on one
// connection (the claim's, a dozen per marker table, and the effects'
// riding statements); the least recently used are deallocated to make
// room. pgx keeps its own, at most StatementCacheCapacity (512 by default).
const maxStmts = 256

// maxRefused bounds the effect statements remembered as impossible to
// prepare (see connState.refused).
const maxRefused = 64

// connState is what the claim keeps on a connection (in its
// pgconn.CustomData): which statements are prepared there, and the parts of
// the connection's configuration it needs, read once.
type connState struct {
	named      bool              // statements are prepared by name (QueryExecModeCacheStatement)
	tracer     pgx.BatchTracer   // the connection's Tracer, when it traces batches
	prepTracer pgx.PrepareTracer // the connection's Tracer, when it traces prepares
	stmts      map[string]*prepared
	clock      uint64 // counts prepare calls, for prepared.used
	// drop are names of statements no longer in stmts (forgotten, or
	// evicted to make room) but maybe still prepared on the server,
	// deallocated by the next prepare.
	drop []string
	// refused are effect statements the server would not prepare (a
	// missing table, or the name of a statement pgx prepared, which the
	// server reads as SQL): they do not ride on this connection, so a
	// failing Parse is not sent with every delivery.
	refused map[string]bool
	// open are the events claimed in the transaction openXact (the
	// connection's last to claim one) and not completed yet, each with its
	// marker row's xmin (see claimOpen); openCount is how many that
	// transaction claimed.
	open      map[[32]byte]string
	openXact  string
	openCount int
	eqb       pgx.ExtendedQueryBuilder
	trip      trip // reused: a connection runs one round trip at a time
}

// prepared is a statement prepared on the connection, and the prepare call
// that last needed it.
type prepared struct {
	sd   *pgconn.StatementDescription
	used uint64
}

const connStateKey = "github.com/dedupactivity/dedupactivity/dedupactivity"

func stateOf(conn *pgx.Conn) *connState {
	data := conn.PgConn().CustomData()
	if s, ok := data[connStateKey].(*connState); ok {
		return s
	}
	cfg := conn.Config() // a copy: once per connection
	s := &connState{
		named:   cfg.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement && cfg.StatementCacheCapacity > 0,
		stmts:   make(map[string]*prepared),
		refused: make(map[string]bool),
	}
	s.tracer, _ = cfg.Tracer.(pgx.BatchTracer)
	s.prepTracer, _ = cfg.Tracer.(pgx.PrepareTracer)
	data[connStateKey] = s
	return s
}

// claimOpen remembers that the event sum was claimed in the top-level
// transaction xact, inserting a marker row whose xmin is xmin, by ClaimTx
// or by a wrapper's claim that inserted the key before its effect, so that
// ClaimTx of that event again in that transaction before Complete is said
// plainly, also when the first claim ran in a savepoint (whose own
// transaction ID, not xact, is then the row's xmin) or results are
// discarded (the row's empty result then reads as completed). A row read
// later is that claim's only if its xmin is the same: not once a
// savepoint rolled it back, nor another table's. Only the last
// transaction's claims are kept: a connection runs one transaction at a
// time, so the others ended.
func (s *connState) claimOpen(sum [32]byte, xact, xmin string) {
	if xact != s.openXact {
		if s.openCount > 64 {
			s.open = nil // a large transaction's map, which clear would keep
		}
		clear(s.open)
		s.openXact, s.openCount = xact, 0
	}
	if s.open == nil {
		s.open = make(map[[32]byte]string)
	}
	s.open[sum] = xmin
	s.openCount++
}

// openIn is the top-level transaction whose open claim of the event sum
// inserted the marker row whose xmin is xmin, or "" if the connection holds
// no such claim.
func (s *connState) openIn(sum [32]byte, xmin string) string {
	if x, ok := s.open[sum]; ok && x == xmin {
		return s.openXact
	}
	return ""
}

// completed forgets the open claim of the event sum, completed in the
// transaction it was claimed in.
func (s *connState) completed(sum [32]byte) { delete(s.open, sum) }

// described is the description of the statement sql prepared on the
// connection, or nil.
func (s *connState) described(sql string) *pgconn.StatementDescription {
	if p := s.stmts[sql]; p != nil {
		return p.sd
	}
	return nil
}

// forget empties the cache, after the server said a statement in it is
// missing or stale (pgx's DeallocateAll, a pooler that moved the session, a
// table whose columns changed). Until the next prepare the claim's
// statements are sent unnamed; that prepare deallocates the old names and
// prepares again what it needs.
func (s *connState) forget() {
	for _, p := range s.stmts {
		s.drop = append(s.drop, p.sd.Name)
	}
	clear(s.stmts)
}

// stale says whether err means a prepared statement of the connection is
// missing (26000) or no longer matches its tables (0A000 from the plan
// cache's check; other 0A000 errors, such as a planner's, are the
// statement's own). The routine's name is not translated, the message is.
func stale(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return pgErr.Code == "26000" || pgErr.Code == "0A000" && pgErr.Routine == "RevalidateCachedQuery"
}

// lasting says whether err, a statement's failure to prepare, will happen
// again: an error of the statement itself, not of the moment (a lock it
// waited for, a cancellation, a deadlock, resources, the connection).
func lasting(err error) bool {
	code := sqlState(err)
	if len(code) != 5 {
		return false
	}
	switch code[:2] {
	case "08", "40", "53", "55", "57", "58":
		return false
	}
	return true
}

// prepare prepares, in one round trip, those of the claim's statements and
// of the effect's statement q (an SQL text, or "") that conn does not have
// yet. Each is deallocated first, which the server does not mind when it
// has no such statement: a statement of that name left there (the cache was
// emptied by forget, or a pooler gave the session another server
// connection) is replaced. It needs conn outside a failed transaction,
// which the claim's callers ensure. When q cannot be prepared (now or
// before on this connection) the error is errNotRidden: q does not ride.
func (s *connState) prepare(ctx context.Context, conn *pgx.Conn, q string, stmts ...*stmt) error {
	if !s.named {
		if q != "" {
			return errNotRidden
		}
		return nil
	}
	s.clock++
	var todo []*stmt
	for _, st := range stmts {
		if p := s.stmts[st.sql]; p != nil {
			p.used = s.clock
		} else {
			todo = append(todo, st)
		}
	}
	var qst *stmt
	if q != "" {
		switch p := s.stmts[q]; {
		case p != nil:
			p.used = s.clock
		case s.refused[q]:
			return errNotRidden
		default:
			qst = newStmt(q)
			todo = append(todo, qst)
		}
	}
	if len(todo) == 0 && len(s.drop) == 0 {
		return nil
	}
	for len(s.stmts)+len(todo) > maxStmts && s.evict() {
	}
	if span := trace.SpanFromContext(ctx); span.IsRecording() && len(todo) > 0 {
		span.AddEvent(PrepareEvent, trace.WithAttributes(PrepareStatementsKey.Int(len(todo))))
	}
	var traced []context.Context // each statement's, from the PrepareTracer
	if s.prepTracer != nil {
		for _, st := range todo {
			traced = append(traced, s.prepTracer.TracePrepareStart(ctx, conn, pgx.TracePrepareStartData{Name: st.name, SQL: st.sql}))
		}
	}
	p := conn.PgConn().StartPipeline(ctx)
	for _, name := range s.drop {
		p.SendDeallocate(name)
	}
	for _, st := range todo {
		p.SendDeallocate(st.name)
		p.SendPrepare(st.name, st.sql, st.params)
	}
	err := p.Sync()
	for range s.drop {
		if err == nil {
			_, err = p.GetResults()
		}
	}
	if err == nil {
		s.drop = s.drop[:0]
	}
	for i, st := range todo {
		skipped := err != nil // an earlier one failed: the server skipped this one
		if !skipped {
			if _, err = p.GetResults(); err == nil { // the deallocation
				err = s.readDescription(p, st)
			}
		}
		if traced != nil {
			s.prepTracer.TracePrepareEnd(traced[i], conn, pgx.TracePrepareEndData{Err: err})
		}
		if !skipped && err != nil && st == qst {
			if lasting(err) {
				if len(s.refused) >= maxRefused {
					clear(s.refused)
				}
				s.refused[q] = true
			}
			err = fmt.Errorf("%w: %w", errNotRidden, err)
		}
	}
	if cerr := p.Close(); err == nil {
		err = cerr
	}
	if err == nil || errors.Is(err, errNotRidden) {
		return err
	}
	return fmt.Errorf("dedupactivity: prepare: %w", err)
}

// notRiddenCause is the statement's own error in err, an errNotRidden from
// prepare or addQuery, without errNotRidden, so that it no longer reads as
// a statement that may be sent after the claim.
func notRiddenCause(err error) error {
	if u, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range u.Unwrap() {
			if e != errNotRidden {
				return e
			}
		}
	}
	return err
}

// evict moves the least recently used statement that this prepare call does
// not need to drop; false when there is none.
func (s *connState) evict() bool {
	var oldest *prepared
	for _, p := range s.stmts {
		if p.used < s.clock && (oldest == nil || p.used < oldest.used) {
			oldest = p
		}
	}
	if oldest == nil {
		return false
	}
	s.drop = append(s.drop, oldest.sd.Name)
	delete(s.stmts, oldest.sd.SQL)
	return true
}

// readDescription reads the description of st, just prepared.
func (s *connState) readDescription(p *pgconn.Pipeline, st *stmt) error {
	res, err := p.GetResults()
	if err != nil {
		return err
	}
	sd, ok := res.(*pgconn.StatementDescription)
	if !ok {
		return fmt.Errorf("dedupactivity: prepare: got %T, not a statement description", res)
	}
	sd.Name, sd.SQL = st.name, st.sql // the pipeline fills in only the types
	s.stmts[st.sql] = &prepared{sd: sd, used: s.clock}
	return nil
}

// trip is one round trip of the claim on conn: statements queued with add
// (the claim's) and addQuery (the effect's), sent by send, and their results
// read in order.
type trip struct {
	conn   *pgx.Conn
	s      *connState
	b      pgconn.Batch
	buf    []byte            // the next statement's parameter values, end to end
	ends   []int             // where each value ends in buf; -1 for NULL
	vals   [][]byte          // the values, cut from buf by add
	traced []pgx.QueuedQuery // what the tracer is told, when there is one
	mrr    *pgconn.MultiResultReader
	ctx    context.Context
	err    error // the first error reading the results
}

// newTrip starts a round trip on conn, reusing the connection's.
func newTrip(conn *pgx.Conn) *trip {
	s := stateOf(conn)
	t := &s.trip
	if t.mrr != nil {
		// The last one is still being read: this one fails as pgx's calls
		// do then (conn busy), without disturbing it.
		t = &trip{}
	}
	*t = trip{conn: conn, s: s, buf: t.buf[:0], ends: t.ends[:0], vals: t.vals[:0]}
	if t.buf == nil {
		t.buf = make([]byte, 0, 256) // never nil, so an empty value is empty, not NULL
	}
	return t
}

// Parameter values of the next statement, in its order. A nil []byte is
// NULL.
func (t *trip) bytea(b []byte) *trip {
	if b == nil {
		t.ends = append(t.ends, -1)
		return t
	}
	t.buf = append(t.buf, b...)
	return t.end()
}

func (t *trip) text(s string) *trip {
	t.buf = append(t.buf, s...)
	return t.end()
}

func (t *trip) int4(v int32) *trip {
	t.buf = binary.BigEndian.AppendUint32(t.buf, uint32(v))
	return t.end()
}

func (t *trip) oid(v uint32) *trip {
	t.buf = binary.BigEndian.AppendUint32(t.buf, v)
	return t.end()
}

// timestamptz is sent as microseconds since 2000-01-01 UTC.
func (t *trip) timestamptz(v time.Time) *trip {
	us := v.Unix()*1_000_000 + int64(v.Nanosecond())/1000 - 946_684_800_000_000
	t.buf = binary.BigEndian.AppendUint64(t.buf, uint64(us))
	return t.end()
}

func (t *trip) tid(v pgtype.TID) *trip {
	t.buf = binary.BigEndian.AppendUint32(t.buf, v.BlockNumber)
	t.buf = binary.BigEndian.AppendUint16(t.buf, v.OffsetNumber)
	return t.end()
}

// lockTimeout is d as a lock_timeout setting (see appendLockTimeout).
func (t *trip) lockTimeout(d time.Duration) *trip {
	t.buf = appendLockTimeout(t.buf, d)
	return t.end()
}

func (t *trip) end() *trip {
	t.ends = append(t.ends, len(t.buf))
	return t
}

// add queues st with the parameter values given since the last add.
func (t *trip) add(st *stmt) {
	t.vals = t.vals[:0]
	start := 0
	for _, end := range t.ends {
		if end < 0 {
			t.vals = append(t.vals, nil)
			continue
		}
		t.vals = append(t.vals, t.buf[start:end:end])
		start = end
	}
	if sd := t.s.described(st.sql); sd != nil {
		t.b.ExecStatement(sd, t.vals, binaryFormat, binaryFormat)
	} else { // not prepared here (not named, or forgotten since)
		t.b.ExecParams(st.sql, t.vals, st.params, binaryFormat, binaryFormat)
	}
	// The batch has copied the values.
	t.buf, t.ends = t.buf[:0], t.ends[:0]
	if t.s.tracer != nil {
		t.traced = append(t.traced, pgx.QueuedQuery{SQL: st.sql})
	}
}

// addQuery queues the effect's statement sql with its arguments, encoded as
// pgx would encode them for the statement prepared on the connection (see
// connState.prepare). Nothing is queued when they cannot be: the error is
// errNotRidden.
func (t *trip) addQuery(sql string, args []any) error {
	sd := t.s.described(sql)
	if sd == nil {
		return errNotRidden
	}
	if err := t.s.eqb.Build(t.conn.TypeMap(), sd, args); err != nil {
		return fmt.Errorf("%w: %w", errNotRidden, err)
	}
	// The batch keeps ResultFormats to read the result with, and eqb reuses
	// it only in a later round trip.
	t.b.ExecStatement(sd, t.s.eqb.ParamValues, t.s.eqb.ParamFormats, t.s.eqb.ResultFormats)
	if t.s.tracer != nil {
		t.traced = append(t.traced, pgx.QueuedQuery{SQL: sql, Arguments: args})
	}
	return nil
}

// send writes the round trip.
func (t *trip) send(ctx context.Context) {
	t.ctx = ctx
	if t.s.tracer != nil {
		b := &pgx.Batch{}
		for i := range t.traced {
			b.QueuedQueries = append(b.QueuedQueries, &t.traced[i])
		}
		t.ctx = t.s.tracer.TraceBatchStart(ctx, t.conn, pgx.TraceBatchStartData{Batch: b})
	}
	t.mrr = t.conn.PgConn().ExecBatch(ctx, &t.b)
}

// next returns the result of the next statement queued, which the caller
// reads and closes (closeResult) before the next. A statement that failed,
// or was skipped after one did, has no result: the error is the failure's.
func (t *trip) next() (*pgconn.ResultReader, error) {
	if t.err != nil {
		return nil, t.err
	}
	if t.mrr.NextResult() {
		return t.mrr.ResultReader(), nil
	}
	t.err = t.mrr.Close()
	if t.err == nil {
		t.err = errors.New("dedupactivity: the server sent fewer results than statements")
	}
	t.traceQuery(pgconn.CommandTag{}, t.err)
	return nil, t.err
}

// row reads the next statement's result, one row at most: scan gets its
// columns, in binary, valid only during the call. found says whether there
// was a row.
func (t *trip) row(scan func(cols [][]byte) error) (found bool, err error) {
	rr, err := t.next()
	if err != nil {
		return false, err
	}
	if rr.NextRow() {
		found = true
		err = scan(rr.Values())
	}
	if _, cerr := t.closeResult(rr); err == nil {
		err = cerr
	}
	return found, err
}

// exec reads the next statement's result, its command tag.
func (t *trip) exec() (pgconn.CommandTag, error) {
	rr, err := t.next()
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.closeResult(rr)
}

// closeResult closes one statement's result and tells the tracer.
func (t *trip) closeResult(rr *pgconn.ResultReader) (pgconn.CommandTag, error) {
	tag, err := rr.Close()
	if err != nil && t.err == nil {
		t.err = err
	}
	t.traceQuery(tag, err)
	return tag, err
}

func (t *trip) traceQuery(tag pgconn.CommandTag, err error) {
	if t.s.tracer == nil || len(t.traced) == 0 {
		return
	}
	q := t.traced[0]
	t.traced = t.traced[1:]
	t.s.tracer.TraceBatchQuery(t.ctx, t.conn, pgx.TraceBatchQueryData{SQL: q.SQL, Args: q.Arguments, CommandTag: tag, Err: err})
}

// close reads what is left of the round trip and returns its first error.
// A stale prepared statement empties the connection's cache (see forget).
func (t *trip) close() error {
	if t.mrr == nil {
		return t.err
	}
	if err := t.mrr.Close(); t.err == nil {
		t.err = err
	}
	for len(t.traced) > 0 { // statements skipped after a failure
		t.traceQuery(pgconn.CommandTag{}, t.err)
	}
	if t.s.tracer != nil {
		t.s.tracer.TraceBatchEnd(t.ctx, t.conn, pgx.TraceBatchEndData{Err: t.err})
	}
	if t.err != nil && stale(t.err) {
		t.s.forget()
	}
	t.mrr, t.ctx = nil, nil
	return t.err
}

// Binary result columns.

func colBool(v []byte) (bool, error) {
	if len(v) != 1 {
		return false, fmt.Errorf("dedupactivity: bool column of %d bytes", len(v))
	}
	return v[0] != 0, nil
}

func colUint32(v []byte) (uint32, error) {
	if len(v) != 4 {
		return 0, fmt.Errorf("dedupactivity: 4-byte column of %d bytes", len(v))
	}
	return binary.BigEndian.Uint32(v), nil
}

func colTID(v []byte) (pgtype.TID, error) {
	if len(v) != 6 {
		return pgtype.TID{}, fmt.Errorf("dedupactivity: tid column of %d bytes", len(v))
	}
	return pgtype.TID{BlockNumber: binary.BigEndian.Uint32(v), OffsetNumber: binary.BigEndian.Uint16(v[4:]), Valid: true}, nil
}
