package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/dedupactivity/dedupactivity/internal/pgtest"
	"github.com/dedupactivity/dedupactivity/internal/receipts"
)

// receiptsService is cmd/receipts running as its own process, on a fixed
// loopback port (so a restart comes back at the same address), with its own
// database.
type receiptsService struct {
	url   string        // http://127.0.0.1:port
	pool  *pgxpool.Pool // its database, for the check
	bin   string
	addr  string
	dbURL string
	mu    sync.Mutex
	proc  *proc
}

func startReceipts(ctx context.Context, bin, dbURL string) (*receiptsService, error) {
	port, err := pgtest.FreePort()
	if err != nil {
		return nil, err
	}
	addr := "127.0.0.1:" + strconv.Itoa(port)
	s := &receiptsService{url: "http://" + addr, bin: bin, addr: addr, dbURL: dbURL}
	if err := s.up(ctx); err != nil {
		return nil, err
	}
	if s.pool, err = pgxpool.New(ctx, dbURL); err != nil {
		s.stop()
		return nil, err
	}
	return s, nil
}

// up starts the process unless it runs, and waits until it answers,
// starting it again if it exits (it does when PostgreSQL is down at its
// migration), for up to a minute.
func (s *receiptsService) up(ctx context.Context) error {
	deadline := time.Now().Add(time.Minute)
	for {
		s.mu.Lock()
		if s.proc == nil || !s.proc.alive() {
			cmd := exec.Command(s.bin, "-addr", s.addr)
			cmd.Env = append(os.Environ(), "DATABASE_URL="+s.dbURL)
			p, err := startProc(cmd)
			if err != nil {
				s.mu.Unlock()
				return fmt.Errorf("start receipts service: %w", err)
			}
			s.proc = p
		}
		s.mu.Unlock()
		if s.answers(ctx) {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("receipts service did not answer within a minute")
		}
		if !sleep(ctx, 100*time.Millisecond) {
			return ctx.Err()
		}
	}
}

func (s *receiptsService) answers(ctx context.Context) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url+receipts.StatusPath+"/probe", nil)
	if err != nil {
		return false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusNotFound
}

// kill SIGKILLs the process: requests in flight die with it and their
// transactions roll back.
func (s *receiptsService) kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		s.proc.kill()
	}
}

func (s *receiptsService) stop() {
	if s.pool != nil {
		s.pool.Close()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		s.proc.stop(5 * time.Second)
	}
}
