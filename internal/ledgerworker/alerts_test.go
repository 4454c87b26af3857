package ledgerworker_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/internal/obstest"
)

// TestAlertRules checks deploy/prometheus with Prometheus's promtool: the
// configuration the compose stack's Prometheus runs is valid and its rule
// files load, and the unit tests of alerts_test.yml pass: each alert fires
// on the series it is for, from when it should, and not on the others (nor
// on a counter series that first appears at 1, which is why the library's
// series start at zero). TestObservabilityBackends loads the same rules into
// a real Prometheus beside the worker, whose metric and label names they
// must use.
func TestAlertRules(t *testing.T) {
	t.Parallel()
	promtool := obstest.Require(t, "promtool")
	for _, args := range [][]string{
		{"check", "config", "prometheus.yml"},
		{"check", "rules", "alerts.yml"},
		{"test", "rules", "alerts_test.yml"},
	} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "../../deploy/prometheus"
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	}
}
