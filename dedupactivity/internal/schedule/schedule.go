// Package schedule creates the Temporal Schedules of the dedupactivity
// packages' Ensure...Schedule functions, and keeps their interval and what
// they start as the caller last asked.
package schedule

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

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
//   - its workflow's task queue is set to opts.Action's when it names its
//     workflow by a string (a Schedule left on a task queue no worker polls
//     any more starts workflows nothing runs); the rest of the action
//     (timeouts, memo) stays.
//
// A Schedule with the ID that starts another workflow type, or the same one
// with other arguments (another table's pruner, say), is left as it is, and
// Ensure returns an error wrapping ErrTaken: two callers giving one ID to
// different work would otherwise take the Schedule from one another at
// each start, and leave one of them never run. Arguments it cannot read
// (encoded by a converter other than the default, such as a codec's) are
// taken as the same.
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
			case have.Workflow != want.Workflow || otherArgs(have.Args, want.Args):
				return nil, fmt.Errorf("%w: Schedule %q starts %v with arguments %s, not %v with %v: give each its own Schedule ID (or delete the Schedule to have it made again)",
					ErrTaken, opts.ID, have.Workflow, argsText(have.Args), want.Workflow, want.Args)
			case have.TaskQueue != want.TaskQueue:
				action := *have
				action.TaskQueue = want.TaskQueue
				s.Action, changed = &action, true
			}
		}
		if !changed {
			return nil, temporal.ErrSkipScheduleUpdate
		}
		return &client.ScheduleUpdate{Schedule: &s}, nil
	}})
}

// ErrTaken is returned by Ensure for a Schedule ID that another caller's
// Schedule, starting other work, holds.
var ErrTaken = errors.New("the Schedule ID is taken")

// otherArgs says whether the arguments a Schedule's description holds (as
// payloads) are known to differ from want: some are JSON, as the default
// data converter encodes them, and not as it encodes want's, or their
// numbers differ. Those another converter encoded are not known to.
func otherArgs(have, want []any) bool {
	if len(have) != len(want) {
		return true
	}
	dc := converter.GetDefaultDataConverter()
	for i, h := range have {
		p, ok := h.(*commonpb.Payload)
		if !ok || string(p.GetMetadata()[converter.MetadataEncoding]) != converter.MetadataEncodingJSON {
			continue
		}
		if w, err := dc.ToPayload(want[i]); err == nil && !bytes.Equal(p.GetData(), w.GetData()) {
			return true
		}
	}
	return false
}

// argsText is the arguments of a Schedule's description as text: the JSON
// ones as they are, the others by their encoding.
func argsText(args []any) string {
	parts := make([]string, len(args))
	for i, a := range args {
		p, ok := a.(*commonpb.Payload)
		switch {
		case !ok:
			parts[i] = fmt.Sprint(a)
		case string(p.GetMetadata()[converter.MetadataEncoding]) == converter.MetadataEncodingJSON:
			parts[i] = string(p.GetData())
		default:
			parts[i] = "(" + string(p.GetMetadata()[converter.MetadataEncoding]) + ")"
		}
	}
	return "[" + strings.Join(parts, ", ") + "]"
}
