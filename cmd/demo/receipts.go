package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

// receiptsService is the receipts service running as its own process, with
// its own database on the demo's PostgreSQL server.
type receiptsService struct {
	URL  string
	Pool *pgxpool.Pool // the receipts database, for the final check
	cmd  *exec.Cmd
	dir  string

	adminURL, db string // the server the database was created on, and its name
}

// startReceipts creates the receipts database, builds cmd/receipts and runs
// it on a free loopback port.
func startReceipts(ctx context.Context, dbURL string) (_ *receiptsService, err error) {
	u, err := url.Parse(dbURL)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return nil, err
	}
	name := "receipts_" + randomHex()
	_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	conn.Close(ctx)
	if err != nil {
		return nil, fmt.Errorf("create receipts database: %w", err)
	}
	s := &receiptsService{adminURL: dbURL, db: name}
	defer func() {
		if err != nil && s.cmd == nil { // once the process runs, Stop cleans up
			_ = os.RemoveAll(s.dir)
			s.dropDatabase()
		}
	}()
	u.Path = "/" + name
	rURL := u.String()

	if s.dir, err = os.MkdirTemp("", "demo-receipts-"); err != nil {
		return nil, err
	}
	dir := s.dir
	bin := filepath.Join(dir, "receipts")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/dedupactivity/dedupactivity/cmd/receipts").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build cmd/receipts: %w\n%s", err, out)
	}
	port, err := pgtest.FreePort()
	if err != nil {
		return nil, err
	}
	addr := "127.0.0.1:" + strconv.Itoa(port)
	cmd := exec.Command(bin, "-addr", addr)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+rURL)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start receipts service: %w", err)
	}
	s.URL, s.cmd = "http://"+addr, cmd
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(s.URL + "/idempotency-keys/probe")
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			s.Stop()
			return nil, errors.New("receipts service did not answer within 30s")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if s.Pool, err = pgxpool.New(ctx, rURL); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

// Stop ends the process, removes its binary and drops its database (on a
// server of your own, DATABASE_URL's, it would stay otherwise).
func (s *receiptsService) Stop() {
	if s.Pool != nil {
		s.Pool.Close()
	}
	_ = s.cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = s.cmd.Process.Kill()
		<-done
	}
	_ = os.RemoveAll(s.dir)
	s.dropDatabase()
}

// dropDatabase drops the receipts database, saying so if it cannot.
func (s *receiptsService) dropDatabase() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.adminURL)
	if err == nil {
		_, err = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{s.db}.Sanitize()+" WITH (FORCE)")
		_ = conn.Close(ctx)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "demo: drop the receipts database %s: %v\n", s.db, err)
	}
}
