package temporaltest

import (
	"context"
	"sync/atomic"

	"go.temporal.io/sdk/interceptor"
)

// HeartbeatCounter is a worker interceptor (worker.Options.Interceptors)
// that counts the activities' RecordHeartbeat calls as they make them: the
// SDK sends at most one per throttle interval (0.8 of the heartbeat
// timeout), which a test environment's heartbeat listener would show.
type HeartbeatCounter struct {
	interceptor.WorkerInterceptorBase
	n atomic.Int64
}

// Count is the number of RecordHeartbeat calls so far.
func (h *HeartbeatCounter) Count() int64 { return h.n.Load() }

// InterceptActivity counts the activity's RecordHeartbeat calls.
func (h *HeartbeatCounter) InterceptActivity(ctx context.Context, next interceptor.ActivityInboundInterceptor) interceptor.ActivityInboundInterceptor {
	return &heartbeatInbound{ActivityInboundInterceptorBase: interceptor.ActivityInboundInterceptorBase{Next: next}, n: &h.n}
}

type heartbeatInbound struct {
	interceptor.ActivityInboundInterceptorBase
	n *atomic.Int64
}

func (h *heartbeatInbound) Init(outbound interceptor.ActivityOutboundInterceptor) error {
	return h.Next.Init(&heartbeatOutbound{ActivityOutboundInterceptorBase: interceptor.ActivityOutboundInterceptorBase{Next: outbound}, n: h.n})
}

type heartbeatOutbound struct {
	interceptor.ActivityOutboundInterceptorBase
	n *atomic.Int64
}

func (h *heartbeatOutbound) RecordHeartbeat(ctx context.Context, details ...any) {
	h.n.Add(1)
	h.Next.RecordHeartbeat(ctx, details...)
}
