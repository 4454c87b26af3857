package e2e

import (
	"context"
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"

	"github.com/dedupactivity/dedupactivity/internal/obstest"
)

// emitted is what the worker emitted, as Prometheus holds it: for each
// dedup_* metric name (a histogram's under its own name and its _bucket,
// _count and _sum series' names), its label names and their values.
type emitted map[string]map[string]map[string]bool

// scrapedSeries asks p for every dedup_* series.
func scrapedSeries(t *testing.T, p *obstest.Prometheus) emitted {
	t.Helper()
	series, err := p.Query(context.Background(), `{__name__=~"dedup_.+"}`)
	require.NoError(t, err)
	e := emitted{}
	add := func(name string, labels map[string]string) {
		if e[name] == nil {
			e[name] = map[string]map[string]bool{}
		}
		for k, v := range labels {
			if k == "__name__" {
				continue
			}
			if e[name][k] == nil {
				e[name][k] = map[string]bool{}
			}
			e[name][k][v] = true
		}
	}
	for _, s := range series {
		name := s.Metric["__name__"]
		add(name, s.Metric)
		for _, suffix := range []string{"_bucket", "_count", "_sum"} {
			if base, ok := strings.CutSuffix(name, suffix); ok {
				add(base, s.Metric) // the histogram's name
			}
		}
	}
	return e
}

var (
	// quoted is a PromQL string literal.
	quoted = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)
	// dedupName is a metric or label name of this package.
	dedupName = regexp.MustCompile(`\bdedup_[a-z_]+`)
	// grouping is a clause that names labels: by, without, on, ignoring,
	// group_left, group_right.
	grouping = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)`)
	// selector is the label matchers of a vector selector.
	selector = regexp.MustCompile(`\{([^}]*)\}`)
	// matcher is one label matcher.
	matcher = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"`)
)

// checkExpr checks one PromQL expression (where says whose) against what
// the worker emitted: each dedup_* name in it is a metric or label it
// emitted; each label named in a by, without, on or ignoring clause or in a
// selector is a label of a metric the expression reads; each value an
// exact matcher (=) asks for is one that label took, and each regular
// expression (=~) matches one. Grafana's variables are read as ".*".
func checkExpr(t *testing.T, e emitted, where, expr string) {
	t.Helper()
	labels := map[string]map[string]bool{} // of the metrics expr reads
	for _, name := range dedupName.FindAllString(quoted.ReplaceAllString(expr, `""`), -1) {
		if m, ok := e[name]; ok {
			for l, values := range m {
				if labels[l] == nil {
					labels[l] = map[string]bool{}
				}
				for v := range values {
					labels[l][v] = true
				}
			}
		}
	}
	require.NotEmpty(t, labels, "%s reads no metric the worker emits: %s", where, expr)
	isLabel := func(l string) bool { _, ok := labels[l]; return ok || l == "__name__" }
	for _, name := range dedupName.FindAllString(quoted.ReplaceAllString(expr, `""`), -1) {
		_, metric := e[name]
		require.True(t, metric || isLabel(name), "%s names %s, which the worker does not emit: %s", where, name, expr)
	}
	for _, g := range grouping.FindAllStringSubmatch(expr, -1) {
		for _, l := range strings.Split(g[1], ",") {
			if l = strings.TrimSpace(l); l != "" {
				require.True(t, isLabel(l), "%s groups by %s, a label of none of its metrics: %s", where, l, expr)
			}
		}
	}
	vars := strings.NewReplacer(`$namespace`, `.*`, `$task_queue`, `.*`, `$table`, `.*`)
	for _, sel := range selector.FindAllStringSubmatch(expr, -1) {
		for _, m := range matcher.FindAllStringSubmatch(sel[1], -1) {
			label, op, value := m[1], m[2], vars.Replace(m[3])
			require.True(t, isLabel(label), "%s selects on %s, a label of none of its metrics: %s", where, label, expr)
			switch op {
			case "=":
				require.True(t, labels[label][value], "%s: %s=%q is not a value the worker emitted (it did: %v): %s", where, label, value, labels[label], expr)
			case "=~":
				re, err := regexp.Compile(`^(?:` + value + `)$`)
				require.NoError(t, err, "%s: %s", where, expr)
				matched := false
				for v := range labels[label] {
					matched = matched || re.MatchString(v)
				}
				require.True(t, matched, "%s: %s=~%q matches no value the worker emitted (%v): %s", where, label, value, labels[label], expr)
			}
		}
	}
}

// checkDashboard runs every query of the Grafana dashboard against p, which
// scrapes a worker that has claimed, duplicated, pruned, relayed outbox
// messages and reconciled one: each query must pass checkExpr, parse, run
// and return data (the rare outcomes' series are there at zero).
func checkDashboard(t *testing.T, p *obstest.Prometheus) {
	t.Helper()
	ctx := context.Background()
	raw, err := os.ReadFile("../../deploy/grafana/dashboards/dedupactivity.json")
	require.NoError(t, err)
	var dash struct {
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Query struct {
					Query string `json:"query"`
				} `json:"query"`
			} `json:"list"`
		} `json:"templating"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr     string `json:"expr"`
				Exemplar bool   `json:"exemplar"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal(raw, &dash))

	e := scrapedSeries(t, p)
	for _, m := range []string{"dedup_attempts_total", "dedup_claim_duration_seconds_bucket", "dedup_effect_duration_seconds_bucket",
		"dedup_marker_pruned_total", "dedup_marker_oldest_age_seconds", "dedup_marker_overdue_seconds",
		"dedup_outbox_deliveries_total", "dedup_outbox_messages", "dedup_outbox_oldest_pending_age_seconds", "dedup_outbox_reconciled_total"} {
		require.Contains(t, e, m, "the worker emitted %s", m)
	}

	vars := strings.NewReplacer(`"$namespace"`, `".*"`, `"$task_queue"`, `".*"`, `"$table"`, `".*"`, `$__rate_interval`, `1m`)
	exprs := 0
	for _, panel := range dash.Panels {
		for _, target := range panel.Targets {
			exprs++
			checkExpr(t, e, "panel "+panel.Title, target.Expr)
			samples, err := p.Query(ctx, vars.Replace(target.Expr))
			require.NoError(t, err, "panel %q", panel.Title)
			require.NotEmpty(t, samples, "panel %q returns no data: %s", panel.Title, target.Expr)
		}
	}
	require.GreaterOrEqual(t, exprs, 15)

	// Each variable's label_values(selector, label) reads a metric the
	// worker emits, with that label, for every table, queue or namespace.
	require.Len(t, dash.Templating.List, 3)
	for _, v := range dash.Templating.List {
		m := labelValues.FindStringSubmatch(v.Query.Query)
		require.NotNil(t, m, "variable %s: %s is not label_values(selector, label)", v.Name, v.Query.Query)
		sel, label := m[1], m[2]
		checkExpr(t, e, "variable "+v.Name, sel)
		require.True(t, e[dedupName.FindString(sel)][label] != nil, "variable %s: %s has no label %s", v.Name, sel, label)
		samples, err := p.Query(ctx, "count by ("+label+") ("+vars.Replace(sel)+")")
		require.NoError(t, err, "variable %s", v.Name)
		require.NotEmpty(t, samples, "variable %s has no values: %s", v.Name, v.Query.Query)
	}
}

// labelValues is a Grafana variable's query of label values.
var labelValues = regexp.MustCompile(`^label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$`)

// alertRules is the alert rules file the compose stack's Prometheus loads.
const alertRules = "../../deploy/prometheus/alerts.yml"

// checkAlerts checks the alert rules against p, which loaded them and
// scrapes the worker: each expression passes checkExpr (its unit tests in
// alerts_test.yml use series of their own, which cannot tell a name the
// worker does not emit), and Prometheus evaluates every rule without an
// error.
func checkAlerts(t *testing.T, p *obstest.Prometheus) {
	t.Helper()
	raw, err := os.ReadFile(alertRules)
	require.NoError(t, err)
	var file struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &file))
	e := scrapedSeries(t, p)
	n := 0
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			n++
			checkExpr(t, e, "alert "+r.Alert, r.Expr)
		}
	}
	require.GreaterOrEqual(t, n, 8)
	require.Eventually(t, func() bool {
		rules, err := p.Rules(context.Background())
		require.NoError(t, err)
		for _, r := range rules {
			require.NotEqual(t, "err", r.Health, "alert %s: %s", r.Name, r.LastError)
			if r.Health != "ok" {
				return false // not evaluated yet
			}
		}
		return len(rules) == n
	}, 30*time.Second, 250*time.Millisecond, "Prometheus evaluates every alert rule")
}
