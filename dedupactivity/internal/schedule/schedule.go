// Package schedule creates the Temporal Schedules of the dedupactivity
// packages' Ensure...Schedule functions, and keeps their interval as the
// caller last asked.
package schedule

import (
	"context"
	"errors"
	"slices"

	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
)

// Ensure creates the Schedule opts describes, whose spec is intervals
// only. When one with its ID exists already (another worker, or an earlier
// start, made it), its intervals are set to opts.Spec's if they differ, so
// that a changed interval takes effect at the next start instead of being
// ignored; the rest of its spec (a jitter, a time zone an operator set),
// its action, policies and state stay as they are. Workers that start
// together asking for different intervals leave the last one's.
func Ensure(ctx context.Context, c client.Client, opts client.ScheduleOptions) error {
	_, err := c.ScheduleClient().Create(ctx, opts)
	if !errors.Is(err, temporal.ErrScheduleAlreadyRunning) {
		return err
	}
	h := c.ScheduleClient().GetHandle(ctx, opts.ID)
	return h.Update(ctx, client.ScheduleUpdateOptions{DoUpdate: func(in client.ScheduleUpdateInput) (*client.ScheduleUpdate, error) {
		s := in.Description.Schedule
		var spec client.ScheduleSpec
		if s.Spec != nil {
			if slices.Equal(s.Spec.Intervals, opts.Spec.Intervals) {
				return nil, temporal.ErrSkipScheduleUpdate
			}
			spec = *s.Spec
		}
		spec.Intervals = opts.Spec.Intervals
		s.Spec = &spec
		return &client.ScheduleUpdate{Schedule: &s}, nil
	}})
}
