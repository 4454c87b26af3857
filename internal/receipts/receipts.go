// Package receipts is the example's receipts service: a separate service,
// with its own PostgreSQL database, that receives a receipt for every
// completed transfer from the ledger's outbox. Its POST /receipts is
// wrapped by the idemhttp middleware, so a receipt re-sent with the same
// Idempotency-Key (a relay that died before acknowledging, a lost response)
// is stored once. cmd/receipts runs it as its own process; tests serve it
// with httptest.
package receipts

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dedupactivity/dedupactivity/activities"
	"github.com/dedupactivity/dedupactivity/dedupactivity/idemhttp"
)

// Paths served by Handler.
const (
	ReceiptsPath = "/receipts"
	StatusPath   = "/idempotency-keys" // GET StatusPath/{key}
)

// Service stores receipts.
type Service struct {
	pool *pgxpool.Pool
	m    *idemhttp.Middleware
}

// New returns the service on pool.
func New(pool *pgxpool.Pool) (*Service, error) {
	m, err := idemhttp.New(pool, idemhttp.Options{RequireKey: true, Scope: "receipts"})
	if err != nil {
		return nil, err
	}
	return &Service{pool: pool, m: m}, nil
}

// Migrate creates the receipt table and the keys' marker table.
func (s *Service) Migrate(ctx context.Context) error {
	if err := s.m.Migrate(ctx); err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(7245002)`); err != nil {
			return err
		}
		// No unique constraint on transfer_id, on purpose: the demo checks,
		// by counting, that the middleware alone keeps receipts single.
		_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS receipt (
	id              bigserial   PRIMARY KEY,
	transfer_id     text        NOT NULL,
	account         text        NOT NULL,
	amount          bigint      NOT NULL,
	idempotency_key text        NOT NULL,
	received_at     timestamptz NOT NULL DEFAULT now())`)
		return err
	})
}

// Prune deletes the keys whose retention is over (the middleware's
// Deduper's Options.Retention), so the key table stays the size of the
// redelivery window. cmd/receipts runs it at start and then every
// -prune-every; it returns how many keys it deleted.
func (s *Service) Prune(ctx context.Context) (int64, error) {
	return s.m.Deduper().Prune(ctx)
}

// Handler serves POST ReceiptsPath and GET StatusPath/{key}.
func (s *Service) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("POST "+ReceiptsPath, s.m.Handler(http.HandlerFunc(s.store)))
	mux.Handle("GET "+StatusPath+"/{key}", s.m.StatusHandler())
	return mux
}

func (s *Service) store(w http.ResponseWriter, r *http.Request) {
	var msg activities.ReceiptMessage
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&msg); err != nil || msg.TransferID == "" {
		http.Error(w, fmt.Sprintf("bad receipt: %v", err), http.StatusBadRequest)
		return
	}
	tx, _ := idemhttp.Tx(r.Context()) // RequireKey: always there
	var id int64
	if err := tx.QueryRow(r.Context(), `INSERT INTO receipt (transfer_id, account, amount, idempotency_key) VALUES ($1, $2, $3, $4) RETURNING id`,
		msg.TransferID, msg.Account, msg.Amount, r.Header.Get(idemhttp.DefaultKeyHeader)).Scan(&id); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError) // rolled back, not stored: the relay retries
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("%s/%d", ReceiptsPath, id))
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(map[string]int64{"id": id})
}

// Counts returns, for each of transferIDs that has any, how many receipts
// the service stored.
func Counts(ctx context.Context, pool *pgxpool.Pool, transferIDs []string) (map[string]int, error) {
	rows, err := pool.Query(ctx, `SELECT transfer_id, count(*) FROM receipt WHERE transfer_id = ANY($1) GROUP BY transfer_id`, transferIDs)
	if err != nil {
		return nil, fmt.Errorf("count receipts: %w", err)
	}
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			rows.Close()
			return nil, err
		}
		out[id] = n
	}
	rows.Close()
	return out, rows.Err()
}
