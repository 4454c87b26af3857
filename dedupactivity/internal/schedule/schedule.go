// Package schedule creates the Temporal Schedules of the dedupactivity
// packages' Ensure...Schedule functions, and keeps their interval and what
// they start as the caller last asked.
package schedule

import (
	"bytes"
	"context"
	"errors"
	"slices"

	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/temporal"
)

// Ensure creates the Schedule opts describes, whose spec is intervals
// only and whose action starts a workflow. When one with its ID exists
// already (another worker, or an earlier start, made it), it is updated
// where it differs from opts, so that a change takes effect at the next
// start instead of being ignored:
//   - its intervals are set to opts.Spec's; the rest of its spec (a jitter,
//     a time zone an operator set) stays;
//   - its workflow's task queue, type and arguments are set to opts.Action's
//     when it names its workflow by a string (a Schedule left on a task
//     queue no worker polls any more starts workflows nothing runs); the
//     rest of the action (timeouts, memo) stays.
//
// Its policies and state (paused, notes) stay as they are. Workers that
// start together asking for different values leave the last one's.
func Ensure(ctx context.Context, c client.Client, opts client.ScheduleOptions) error {
	_, err := c.ScheduleClient().Create(ctx, opts)
	if !errors.Is(err, temporal.ErrScheduleAlreadyRunning) {
		return err
	}
	want, _ := opts.Action.(*client.ScheduleWorkflowAction)
	if want != nil {
		if _, named := want.Workflow.(string); !named {
			want = nil // a function: the description names it, and cannot be compared
		}
	}
	h := c.ScheduleClient().GetHandle(ctx, opts.ID)
	return h.Update(ctx, client.ScheduleUpdateOptions{DoUpdate: func(in client.ScheduleUpdateInput) (*client.ScheduleUpdate, error) {
		s := in.Description.Schedule
		changed := false
		if s.Spec == nil || !slices.Equal(s.Spec.Intervals, opts.Spec.Intervals) {
			var spec client.ScheduleSpec
			if s.Spec != nil {
				spec = *s.Spec
			}
			spec.Intervals = opts.Spec.Intervals
			s.Spec, changed = &spec, true
		}
		if want != nil {
			have, ok := s.Action.(*client.ScheduleWorkflowAction)
			switch {
			case !ok:
				s.Action, changed = want, true
			case have.TaskQueue != want.TaskQueue || have.Workflow != want.Workflow || !sameArgs(have.Args, want.Args):
				action := *have
				action.TaskQueue, action.Workflow, action.Args = want.TaskQueue, want.Workflow, want.Args
				s.Action, changed = &action, true
			}
		}
		if !changed {
			return nil, temporal.ErrSkipScheduleUpdate
		}
		return &client.ScheduleUpdate{Schedule: &s}, nil
	}})
}

// sameArgs says whether the arguments a Schedule's description holds (as
// payloads) are want's, encoded by the default data converter. A client
// with another converter may see them differ and update the Schedule at
// each start, which is harmless.
func sameArgs(have, want []any) bool {
	if len(have) != len(want) {
		return false
	}
	dc := converter.GetDefaultDataConverter()
	for i, h := range have {
		p, ok := h.(*commonpb.Payload)
		if !ok {
			return false
		}
		w, err := dc.ToPayload(want[i])
		if err != nil || !bytes.Equal(p.GetData(), w.GetData()) {
			return false
		}
	}
	return true
}
