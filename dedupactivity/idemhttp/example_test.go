package idemhttp_test

import (
	"context"
	"log"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dedupactivity/dedupactivity/dedupactivity/idemhttp"
)

func ExampleMiddleware_Handler() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost:5432/receipts")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	m, err := idemhttp.New(pool, idemhttp.Options{RequireKey: true})
	if err != nil {
		log.Fatal(err)
	}
	if err := m.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /receipts", m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idemhttp.Tx(r.Context()) // commits with the key's marker
		if _, err := tx.Exec(r.Context(), `INSERT INTO receipt (key) VALUES ($1)`, r.Header.Get("Idempotency-Key")); err != nil {
			log.Printf("store receipt: %v", err)
			http.Error(w, "could not store the receipt", http.StatusInternalServerError) // 5xx: rolled back, not stored
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	mux.Handle("GET /idempotency-keys/{key}", m.StatusHandler()) // for outbox.HTTPChecker
	// Delete the keys whose retention is over now and then (an hourly
	// ticker, a cron job): m.Deduper().Prune(ctx).
	srv := &http.Server{Addr: "127.0.0.1:8081", Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	log.Fatal(srv.ListenAndServe())
}
