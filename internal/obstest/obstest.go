// Package obstest runs the observability backends the tests and the demo
// check against: Jaeger v2 (bin/jaeger, built by make jaeger from the Go
// module proxy) and Prometheus (Debian's prometheus package, on PATH). Both
// listen on 127.0.0.1 only, on free ports, with their data in a temporary
// directory removed by Stop.
package obstest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dedupactivity/dedupactivity/internal/pgtest"

	"github.com/dedupactivity/dedupactivity/internal/toolbin"
)

// Find returns the path of the backend binary name ("jaeger", "prometheus"
// or "promtool"): JAEGER_BIN / PROMETHEUS_BIN / PROMTOOL_BIN, then the
// repository's bin/, then PATH.
func Find(name string) (string, error) {
	if p := os.Getenv(strings.ToUpper(name) + "_BIN"); p != "" {
		return p, nil
	}
	if p, err := toolbin.Path(name); err == nil {
		return p, nil
	}
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	hint := map[string]string{"jaeger": "make jaeger", "prometheus": "apt-get install prometheus",
		"promtool": "apt-get install prometheus, which ships it"}[name]
	return "", fmt.Errorf("%s not found in bin/ or on PATH (%s)", name, hint)
}

// Require returns Find(name) or ends the test: it fails under CI=true and is
// skipped elsewhere.
func Require(tb testing.TB, name string) string {
	tb.Helper()
	p, err := Find(name)
	if err != nil {
		if os.Getenv("CI") == "true" {
			tb.Fatalf("obstest: %v (required under CI=true)", err)
		}
		tb.Skipf("obstest: %v, skipping", err)
	}
	return p
}

// process is a started backend.
type process struct {
	cmd  *exec.Cmd
	dir  string
	done chan error
	log  *os.File
}

func start(path, dir string, args ...string) (*process, error) {
	log, err := os.Create(filepath.Join(dir, "log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(path, args...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("start %s: %w", path, err)
	}
	p := &process{cmd: cmd, dir: dir, done: make(chan error, 1), log: log}
	go func() { p.done <- cmd.Wait() }()
	return p, nil
}

// waitHTTP polls url until it answers 200, the process exits or 60s pass.
func (p *process) waitHTTP(url string) error {
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-p.done:
			p.done <- err
			return fmt.Errorf("exited before it was ready (%v): %s", err, p.tail())
		default:
		}
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("not ready after 60s: %s", p.tail())
}

func (p *process) tail() string {
	b, _ := os.ReadFile(filepath.Join(p.dir, "log"))
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

func (p *process) stop() error {
	_ = p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	p.log.Close()
	return os.RemoveAll(p.dir)
}

func freePorts(n int) ([]int, error) {
	ports := make([]int, n)
	seen := map[int]bool{}
	for i := range ports {
		for {
			p, err := pgtest.FreePort()
			if err != nil {
				return nil, err
			}
			if !seen[p] {
				seen[p], ports[i] = true, p
				break
			}
		}
	}
	return ports, nil
}

// Jaeger is a running Jaeger v2 with in-memory storage.
type Jaeger struct {
	// OTLPEndpoint is the OTLP/gRPC receiver's URL (http://127.0.0.1:port),
	// for OTEL_EXPORTER_OTLP_ENDPOINT.
	OTLPEndpoint string
	// QueryURL is the query service (HTTP API under /api).
	QueryURL string
	p        *process
}

// StartJaeger starts the Jaeger v2 binary at path with a configuration of
// its own: OTLP/gRPC in, in-memory storage, the query API, all on free
// 127.0.0.1 ports.
func StartJaeger(path string) (*Jaeger, error) {
	ports, err := freePorts(4)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "jaeger-")
	if err != nil {
		return nil, err
	}
	config := fmt.Sprintf(`service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:%d
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:%d
    grpc:
      endpoint: 127.0.0.1:%d
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:%d
processors:
  batch: {}
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
`, ports[0], ports[1], ports[2], ports[3])
	if err := os.WriteFile(filepath.Join(dir, "config.yaml"), []byte(config), 0o600); err != nil {
		return nil, err
	}
	p, err := start(path, dir, "--config", filepath.Join(dir, "config.yaml"))
	if err != nil {
		return nil, err
	}
	j := &Jaeger{OTLPEndpoint: fmt.Sprintf("http://127.0.0.1:%d", ports[3]), QueryURL: fmt.Sprintf("http://127.0.0.1:%d", ports[1]), p: p}
	if err := p.waitHTTP(j.QueryURL + "/api/services"); err != nil {
		_ = p.stop()
		return nil, fmt.Errorf("jaeger: %w", err)
	}
	return j, nil
}

// Stop stops Jaeger and removes its directory.
func (j *Jaeger) Stop() error { return j.p.stop() }

// Span is a span as Jaeger's HTTP API returns it.
type Span struct {
	TraceID       string `json:"traceID"`
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	Tags []struct {
		Key   string `json:"key"`
		Value any    `json:"value"`
	} `json:"tags"`
}

// Tag returns the span's tag key as a string ("" when absent).
func (s Span) Tag(key string) string {
	for _, t := range s.Tags {
		if t.Key == key {
			return fmt.Sprint(t.Value)
		}
	}
	return ""
}

// Parent returns the span ID of the span's CHILD_OF parent.
func (s Span) Parent() string {
	for _, r := range s.References {
		if r.RefType == "CHILD_OF" {
			return r.SpanID
		}
	}
	return ""
}

// Trace is a trace as Jaeger's HTTP API returns it.
type Trace struct {
	TraceID string `json:"traceID"`
	Spans   []Span `json:"spans"`
}

// Services lists the services Jaeger holds spans of.
func (j *Jaeger) Services(ctx context.Context) ([]string, error) {
	var out struct {
		Data []string `json:"data"`
	}
	return out.Data, getJSON(ctx, j.QueryURL+"/api/services", &out)
}

// Traces searches service's traces (up to limit) with spans carrying tags.
func (j *Jaeger) Traces(ctx context.Context, service string, tags map[string]string, limit int) ([]Trace, error) {
	q := url.Values{"service": {service}, "limit": {strconv.Itoa(limit)}, "lookback": {"1h"}}
	if len(tags) > 0 {
		b, err := json.Marshal(tags)
		if err != nil {
			return nil, err
		}
		q.Set("tags", string(b))
	}
	var out struct {
		Data []Trace `json:"data"`
	}
	return out.Data, getJSON(ctx, j.QueryURL+"/api/traces?"+q.Encode(), &out)
}

func getJSON(ctx context.Context, u string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", u, resp.Status, b)
	}
	return json.Unmarshal(b, v)
}

// Prometheus is a running Prometheus scraping one target every second.
type Prometheus struct {
	// URL is the HTTP API's base URL.
	URL string
	p   *process
}

// StartPrometheus starts the Prometheus binary at path scraping target
// (host:port, path /metrics) every second as job "ledger-worker", with
// exemplar storage enabled, evaluating the rules of ruleFiles every second.
func StartPrometheus(path, target string, ruleFiles ...string) (*Prometheus, error) {
	ports, err := freePorts(1)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "prometheus-")
	if err != nil {
		return nil, err
	}
	config := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: ledger-worker
    static_configs:
      - targets: [%q]
`, target)
	if len(ruleFiles) > 0 {
		config += "rule_files:\n"
		for _, f := range ruleFiles {
			abs, err := filepath.Abs(f)
			if err != nil {
				return nil, err
			}
			config += fmt.Sprintf("  - %q\n", abs)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(config), 0o600); err != nil {
		return nil, err
	}
	p, err := start(path, dir,
		"--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+fmt.Sprintf("127.0.0.1:%d", ports[0]),
		"--enable-feature=exemplar-storage")
	if err != nil {
		return nil, err
	}
	pr := &Prometheus{URL: fmt.Sprintf("http://127.0.0.1:%d", ports[0]), p: p}
	if err := p.waitHTTP(pr.URL + "/-/ready"); err != nil {
		_ = p.stop()
		return nil, fmt.Errorf("prometheus: %w", err)
	}
	return pr, nil
}

// Stop stops Prometheus and removes its data.
func (p *Prometheus) Stop() error { return p.p.stop() }

// Rule is a recording or alerting rule as Prometheus's rules API lists it.
type Rule struct {
	Name      string `json:"name"`
	Query     string `json:"query"`
	Health    string `json:"health"` // ok, err or unknown (not evaluated yet)
	LastError string `json:"lastError"`
}

// Rules lists the rules Prometheus loaded, of every group.
func (p *Prometheus) Rules(ctx context.Context) ([]Rule, error) {
	var out struct {
		Data struct {
			Groups []struct {
				Rules []Rule `json:"rules"`
			} `json:"groups"`
		} `json:"data"`
	}
	if err := getJSON(ctx, p.URL+"/api/v1/rules", &out); err != nil {
		return nil, err
	}
	var rules []Rule
	for _, g := range out.Data.Groups {
		rules = append(rules, g.Rules...)
	}
	return rules, nil
}

// Sample is one series of an instant query's result.
type Sample struct {
	Metric map[string]string
	Value  float64
}

// Query runs an instant PromQL query and returns its vector (a scalar
// result is one sample with no labels).
func (p *Prometheus) Query(ctx context.Context, promql string) ([]Sample, error) {
	var out struct {
		Status string `json:"status"`
		Data   struct {
			ResultType string          `json:"resultType"`
			Result     json.RawMessage `json:"result"`
		} `json:"data"`
		Error string `json:"error"`
	}
	if err := getJSON(ctx, p.URL+"/api/v1/query?"+url.Values{"query": {promql}}.Encode(), &out); err != nil {
		return nil, err
	}
	if out.Status != "success" {
		return nil, fmt.Errorf("query %q: %s", promql, out.Error)
	}
	parse := func(v [2]any) (float64, error) {
		s, ok := v[1].(string)
		if !ok {
			return 0, errors.New("value is not a string")
		}
		return strconv.ParseFloat(s, 64)
	}
	switch out.Data.ResultType {
	case "vector":
		var vec []struct {
			Metric map[string]string `json:"metric"`
			Value  [2]any            `json:"value"`
		}
		if err := json.Unmarshal(out.Data.Result, &vec); err != nil {
			return nil, err
		}
		samples := make([]Sample, len(vec))
		for i, s := range vec {
			v, err := parse(s.Value)
			if err != nil {
				return nil, err
			}
			samples[i] = Sample{Metric: s.Metric, Value: v}
		}
		return samples, nil
	case "scalar":
		var s [2]any
		if err := json.Unmarshal(out.Data.Result, &s); err != nil {
			return nil, err
		}
		v, err := parse(s)
		return []Sample{{Value: v}}, err
	}
	return nil, fmt.Errorf("query %q: result type %s", promql, out.Data.ResultType)
}

// RedeliveredTrace returns the ID of the first trace in which a
// RunActivity:<activityType> span has a Dedup:<activityType> child that
// claimed the event and another RunActivity:<activityType> span has one that
// was a duplicate: one activity, delivered twice, applied once.
func RedeliveredTrace(traces []Trace, activityType string) (string, bool) {
	for _, tr := range traces {
		runActivity := map[string]bool{}
		for _, s := range tr.Spans {
			if s.OperationName == "RunActivity:"+activityType {
				runActivity[s.SpanID] = true
			}
		}
		outcomes := map[string]bool{}
		for _, s := range tr.Spans {
			if s.OperationName == "Dedup:"+activityType && runActivity[s.Parent()] {
				outcomes[s.Tag("dedup.outcome")] = true
			}
		}
		if outcomes["claimed"] && outcomes["duplicate"] {
			return tr.TraceID, true
		}
	}
	return "", false
}

// Summary is one line on what Jaeger holds for service: traces, spans, and
// Dedup spans by outcome (over up to limit traces).
func (j *Jaeger) Summary(ctx context.Context, service string, limit int) (string, error) {
	traces, err := j.Traces(ctx, service, nil, limit)
	if err != nil {
		return "", err
	}
	spans := 0
	byOutcome := map[string]int{}
	for _, tr := range traces {
		spans += len(tr.Spans)
		for _, s := range tr.Spans {
			if o := s.Tag("dedup.outcome"); o != "" {
				byOutcome[o]++
			}
		}
	}
	var parts []string
	for _, o := range []string{"claimed", "duplicate", "payload_mismatch", "effect_error", "claim_timeout", "error"} {
		if byOutcome[o] > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", o, byOutcome[o]))
		}
	}
	return fmt.Sprintf("Jaeger holds %d traces of %s with %d spans; Dedup spans by outcome: %s", len(traces), service, spans, strings.Join(parts, ", ")), nil
}
