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

// Ensure creates the Schedule opts describes. When one with its ID exists
// already (another worker, or an earlier start, made it), its spec is set
// to opts.Spec if it differs, so that a changed interval takes effect at
// the next start instead of being ignored; its action and policies stay as
// they are. Workers that start together asking for different specs leave
// the last one's.
func Ensure(ctx context.Context, c client.Client, opts client.ScheduleOptions) error {
	_, err := c.ScheduleClient().Create(ctx, opts)
	if !errors.Is(err, temporal.ErrScheduleAlreadyRunning) {
		return err
	}
	h := c.ScheduleClient().GetHandle(ctx, opts.ID)
	return h.Update(ctx, client.ScheduleUpdateOptions{DoUpdate: func(in client.ScheduleUpdateInput) (*client.ScheduleUpdate, error) {
		s := in.Description.Schedule
		if s.Spec != nil && same(*s.Spec, opts.Spec) {
			return nil, temporal.ErrSkipScheduleUpdate
		}
		spec := opts.Spec
		s.Spec = &spec
		return &client.ScheduleUpdate{Schedule: &s}, nil
	}})
}

// same says whether the spec a Schedule has is want, an intervals-only
// spec as Ensure's callers give.
func same(have, want client.ScheduleSpec) bool {
	return slices.Equal(have.Intervals, want.Intervals) &&
		len(have.Calendars) == 0 && len(have.CronExpressions) == 0 && len(have.Skip) == 0
}
