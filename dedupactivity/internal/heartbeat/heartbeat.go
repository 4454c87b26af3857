// Package heartbeat keeps the dedupactivity packages' maintenance
// activities (prune, relay) heartbeating while one statement or send runs
// longer than their HeartbeatTimeout, which is there to find a worker that
// died, not a slow step that something else bounds.
package heartbeat

import (
	"context"
	"sync"
	"time"

	"go.temporal.io/sdk/activity"
)

// Start returns beat, which records a heartbeat of the activity of ctx
// with its details at once, and repeats the last details given (T's zero
// value before the first beat) every interval until stop returns.
func Start[T any](ctx context.Context, every time.Duration) (beat func(T), stop func()) {
	var (
		mu   sync.Mutex
		last T
	)
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				mu.Lock()
				v := last
				mu.Unlock()
				activity.RecordHeartbeat(ctx, v)
			}
		}
	}()
	beat = func(v T) {
		mu.Lock()
		last = v
		mu.Unlock()
		activity.RecordHeartbeat(ctx, v)
	}
	return beat, func() { close(done); <-stopped }
}
