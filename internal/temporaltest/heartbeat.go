package temporaltest

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/interceptor"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/worker"
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

// RunActivity runs the activity that register registers as name in a new
// test activity environment, counting its heartbeats, and returns at once:
// beats counts them as it runs; wait waits (30s at most) for the activity
// to end and decodes its result into out.
func RunActivity(register func(*testsuite.TestActivityEnvironment), name string) (beats *HeartbeatCounter, wait func(out any) error) {
	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestActivityEnvironment()
	beats = &HeartbeatCounter{}
	env.SetWorkerOptions(worker.Options{Interceptors: []interceptor.WorkerInterceptor{beats}})
	register(env)
	type ended struct {
		val converter.EncodedValue
		err error
	}
	done := make(chan ended, 1)
	go func() {
		val, err := env.ExecuteActivity(name)
		done <- ended{val, err}
	}()
	return beats, func(out any) error {
		select {
		case e := <-done:
			if e.err != nil {
				return e.err
			}
			return e.val.Get(out)
		case <-time.After(30 * time.Second):
			return fmt.Errorf("activity %s did not end within 30s", name)
		}
	}
}
