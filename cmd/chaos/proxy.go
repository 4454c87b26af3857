package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/dedupactivity/dedupactivity/dedupactivity/outbox"
)

// proxy stands between the relays and the receipts service, on one
// loopback port per worker slot, and injects the faults of the outbox
// boundary into receipt deliveries (POSTs with an Idempotency-Key):
//
//   - drop: forward, and once the destination answered 2xx (it committed),
//     close the relay's connection without an answer;
//   - kill: the same, but first SIGKILL the worker whose relay sent it, so
//     it dies between send and acknowledgement;
//   - hold: keep a key's first send past the relay's lease, until another
//     relay has taken the message over and sent it too (at most holdFor),
//     then forward both.
//
// When the destination is down it answers 502, as a load balancer would.
// Everything else passes through. It also counts what it saw.
type proxy struct {
	upstream string
	client   *http.Client
	servers  []*http.Server
	urls     []string

	mu         sync.Mutex
	dropEvery  int
	holdEvery  int
	faulting   bool // between arm and disarm
	killArmed  bool
	killSlot   func(slot int) bool
	posts      int                      // receipt POSTs seen
	firstSends int                      // POSTs of a key not seen before
	perKey     map[string]int           // POSTs by key
	inFlight   map[string]int           // POSTs by key being handled now
	held       map[string]chan struct{} // closed when another POST of the key arrives
	c          proxyCounts
}

// proxyCounts is what the proxy saw and did.
type proxyCounts struct {
	Posts        int // receipt POSTs forwarded or refused
	Resends      int // POSTs of a key seen before
	Dropped      int // 2xx responses dropped after the destination committed
	RelaysKilled int // relays SIGKILLed after the destination committed, before they acknowledged
	Held         int // first sends held past the relay lease
	Overlapping  int // POSTs that arrived while another POST of the same key was in flight (two relays)
	Replayed     int // answers the destination replayed from its stored response
	Unavailable  int // 502s: the destination was down
}

func startProxy(upstream string, slots int) (*proxy, error) {
	p := &proxy{
		upstream: upstream,
		client:   &http.Client{Timeout: 10 * time.Second},
		perKey:   map[string]int{},
		inFlight: map[string]int{},
		held:     map[string]chan struct{}{},
	}
	for slot := range slots {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			p.close()
			return nil, err
		}
		srv := &http.Server{Handler: p.handler(slot), ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		p.servers = append(p.servers, srv)
		p.urls = append(p.urls, "http://"+ln.Addr().String())
	}
	return p, nil
}

// url is the base URL slot's worker uses for the receipts service.
func (p *proxy) url(slot int) string { return p.urls[slot] }

func (p *proxy) close() {
	for _, s := range p.servers {
		_ = s.Close()
	}
}

// arm sets the faults of the fault phase; kill is how a relay is killed.
func (p *proxy) arm(dropEvery, holdEvery int, kill func(slot int) bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faulting, p.dropEvery, p.holdEvery, p.killSlot = true, dropEvery, holdEvery, kill
}

// armKill makes the next committed delivery kill its relay.
func (p *proxy) armKill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.killArmed = p.faulting
}

// disarm lets everything pass from now on.
func (p *proxy) disarm() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faulting, p.dropEvery, p.holdEvery, p.killArmed = false, 0, 0, false
}

func (p *proxy) counts() proxyCounts {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.c
}

type fault int

const (
	passThrough fault = iota
	drop
	kill
)

// begin records a receipt POST of key and picks its fault; a held POST
// waits for hold to close.
func (p *proxy) begin(key string) (f fault, hold chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.posts++
	p.c.Posts++
	if p.inFlight[key] > 0 {
		p.c.Overlapping++
	}
	if c, ok := p.held[key]; ok {
		close(c)
		delete(p.held, key)
	}
	p.inFlight[key]++
	p.perKey[key]++
	if p.perKey[key] > 1 {
		p.c.Resends++
	} else {
		p.firstSends++
		if p.holdEvery > 0 && p.firstSends%p.holdEvery == 0 {
			hold = make(chan struct{})
			p.held[key] = hold
		}
	}
	switch {
	case p.killArmed:
		p.killArmed = false
		f = kill
	case p.dropEvery > 0 && p.posts%p.dropEvery == 0:
		f = drop
	}
	return f, hold
}

func (p *proxy) end(key string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.inFlight[key]--; p.inFlight[key] == 0 {
		delete(p.inFlight, key)
	}
	if c, ok := p.held[key]; ok { // nobody took it over
		close(c)
		delete(p.held, key)
	}
}

func (p *proxy) count(f func(c *proxyCounts)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f(&p.c)
}

func (p *proxy) handler(slot int) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		key := r.Header.Get(outbox.IdempotencyKeyHeader)
		f := passThrough
		if r.Method == http.MethodPost && key != "" {
			var hold chan struct{}
			f, hold = p.begin(key)
			defer p.end(key)
			if hold != nil {
				p.count(func(c *proxyCounts) { c.Held++ })
				select {
				case <-hold:
				case <-time.After(holdFor):
				}
			}
		}
		resp, err := p.forward(r.Context(), r, body)
		if err != nil {
			if key != "" {
				p.count(func(c *proxyCounts) { c.Unavailable++ })
			}
			http.Error(w, fmt.Sprintf("proxy: receipts service unavailable: %v", err), http.StatusBadGateway)
			return
		}
		respBody, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			http.Error(w, "proxy: reading the answer: "+err.Error(), http.StatusBadGateway)
			return
		}
		committed := resp.StatusCode >= 200 && resp.StatusCode < 300
		if committed && key != "" && resp.Header.Get("Idempotent-Replayed") == "true" {
			p.count(func(c *proxyCounts) { c.Replayed++ })
		}
		if f == kill {
			if committed && p.killRelay(slot) {
				p.count(func(c *proxyCounts) { c.RelaysKilled++ })
				hangUp(w)
				return
			}
			p.armKill() // not this one: the next
		}
		if committed && f == drop {
			p.count(func(c *proxyCounts) { c.Dropped++ })
			hangUp(w)
			return
		}
		for k, vs := range resp.Header {
			w.Header()[k] = vs
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(respBody)
	})
}

func (p *proxy) killRelay(slot int) bool {
	p.mu.Lock()
	kill := p.killSlot
	p.mu.Unlock()
	return kill != nil && kill(slot)
}

func (p *proxy) forward(ctx context.Context, r *http.Request, body []byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, r.Method, p.upstream+r.URL.RequestURI(), bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header = r.Header.Clone()
	return p.client.Do(req)
}

// hangUp closes the client's connection without an answer.
func hangUp(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler) // closes the connection too
	}
	_ = conn.Close()
}
