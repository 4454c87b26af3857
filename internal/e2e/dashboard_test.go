package e2e

import (
	"context"
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
	"github.com/dedupactivity/dedupactivity/internal/obstest"
)

// checkDashboard runs every query of the Grafana dashboard against p, which
// scrapes a worker that has claimed, duplicated, pruned, relayed outbox
// messages and reconciled one: each query must parse and run, every dedup_*
// name in it must be a metric or a label the worker emitted, every
// dedup_outcome value an Outcome, and the panels on attempts, duplicates,
// latencies and the outbox's sends and backlog must return data.
func checkDashboard(t *testing.T, p *obstest.Prometheus) {
	t.Helper()
	ctx := context.Background()
	raw, err := os.ReadFile("../../deploy/grafana/dashboards/dedupactivity.json")
	require.NoError(t, err)
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr     string `json:"expr"`
				Exemplar bool   `json:"exemplar"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal(raw, &dash))

	// What the worker emitted, as Prometheus holds it.
	emitted := map[string]bool{}
	series, err := p.Query(ctx, `{__name__=~"dedup_.+"}`)
	require.NoError(t, err)
	for _, s := range series {
		name := s.Metric["__name__"]
		emitted[name] = true
		for _, suffix := range []string{"_bucket", "_count", "_sum"} {
			emitted[strings.TrimSuffix(name, suffix)] = true // the histogram's name
		}
		for label := range s.Metric {
			emitted[label] = true
		}
	}
	for _, m := range []string{"dedup_attempts_total", "dedup_claim_duration_seconds_bucket", "dedup_effect_duration_seconds_bucket",
		"dedup_marker_pruned_total", "dedup_marker_oldest_age_seconds",
		"dedup_outbox_deliveries_total", "dedup_outbox_messages", "dedup_outbox_oldest_pending_age_seconds", "dedup_outbox_reconciled_total"} {
		require.True(t, emitted[m], "the worker emitted %s", m)
	}
	outcomes := map[string]bool{}
	for _, o := range []dedupactivity.Outcome{dedupactivity.OutcomeClaimed, dedupactivity.OutcomeDuplicate, dedupactivity.OutcomePayloadMismatch,
		dedupactivity.OutcomeEffectError, dedupactivity.OutcomeClaimTimeout, dedupactivity.OutcomeError} {
		outcomes[string(o)] = true
	}

	vars := strings.NewReplacer(`"$namespace"`, `".*"`, `"$task_queue"`, `".*"`, `"$table"`, `".*"`, `$__rate_interval`, `1m`)
	withData := map[string]bool{"Attempts by outcome, per activity type": true, "Duplicate ratio": true,
		"Claim wait p50 / p99": true, "Effect duration p50 / p99": true, "Oldest marker age": true,
		"Outbox sends by result": true, "Outbox messages waiting": true, "Oldest undelivered outbox message": true,
		// Their counters' series start at zero (a series that first
		// appears at 1 shows no increase, however many samples follow).
		"Markers pruned": true, "Outbox reconciler actions": true}
	exprs := 0
	for _, panel := range dash.Panels {
		for _, target := range panel.Targets {
			exprs++
			for _, name := range regexp.MustCompile(`\bdedup_[a-z_]+`).FindAllString(target.Expr, -1) {
				require.True(t, emitted[name], "panel %q names %s, which the worker does not emit", panel.Title, name)
			}
			for _, m := range regexp.MustCompile(`dedup_outcome="([^"]*)"`).FindAllStringSubmatch(target.Expr, -1) {
				require.True(t, outcomes[m[1]], "panel %q: %q is not an Outcome", panel.Title, m[1])
			}
			for _, label := range []string{"namespace", "task_queue", "activity_type"} {
				if strings.Contains(target.Expr, label) {
					require.True(t, emitted[label], "label %s", label)
				}
			}
			samples, err := p.Query(ctx, vars.Replace(target.Expr))
			require.NoError(t, err, "panel %q", panel.Title)
			if withData[panel.Title] {
				require.NotEmpty(t, samples, "panel %q: %s", panel.Title, target.Expr)
			}
		}
	}
	require.GreaterOrEqual(t, exprs, 14)
}
