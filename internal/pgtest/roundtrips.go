package pgtest

import (
	"context"
	"net"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// CountRoundTrips makes every connection cfg dials add its client writes to
// n. pgx sends a query, batch or pipeline in one write and then waits for the
// answer, so writes count round trips.
func CountRoundTrips(cfg *pgx.ConnConfig, n *atomic.Int64) {
	dial := cfg.DialFunc
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return countingConn{Conn: c, writes: n}, nil
	}
}

type countingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}
