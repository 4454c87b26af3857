.DEFAULT_GOAL := help
SHELL := /bin/bash

GO        ?= go
# The toolchain every target builds with (go.mod and go.work name it too): go1.27.3 clears the
# twelve standard-library vulnerabilities govulncheck reports as reachable under go1.26.8 (net/http,
# crypto/tls, crypto/x509, html/template, net/textproto). The go command takes it from the Go module
# proxy on first use (76 MB, about 10 seconds). The library itself still builds with Go 1.26
# (go.mod's go line); GOTOOLCHAIN=local make ... builds with the Go on PATH.
export GOTOOLCHAIN ?= go1.27.3
GOVERSION := $(shell GOTOOLCHAIN=$(GOTOOLCHAIN) $(GO) env GOVERSION)
ifeq ($(GOVERSION),)
$(error "$(GO) env GOVERSION" gave nothing with GOTOOLCHAIN=$(GOTOOLCHAIN): is Go on PATH, and the module proxy reachable for the toolchain?)
endif
BIN       := $(CURDIR)/bin
TEMPORAL  := $(BIN)/temporal
TEMPORAL_CLI_VERSION := v1.5.1
JAEGER    := $(BIN)/jaeger
# Every package of both modules of the workspace (go.work): the library and
# example (.), and the tooling (./cmd), whose dependencies users do not get.
PKGS      := ./... ./cmd/...
# make fuzz runs each target FUZZTIME executions: a count, not a duration, so
# a run does the same work on a fast or a busy machine, and because under
# go1.26 (GOTOOLCHAIN=local) a duration can end in a spurious "context
# deadline exceeded" with no failing input (golang/go#75804, fixed in Go 1.27).
# .ci/run takes 30000x, about 9 s per target here.
FUZZTIME  ?= 100000x
export PATH := $(BIN):$(PATH)

# Lint tools, built from the Go module proxy into bin/ (git-ignored) at pinned versions; a
# stamp file per version and toolchain rebuilds a tool when either changes (staticcheck and
# govulncheck must understand the toolchain's standard library). A build removes the tool's
# other stamps: they name the same binary, which it overwrites. The Temporal CLI and Jaeger are
# programs the tests run, not tools that read this code: built once, whatever the toolchain.
STATICCHECK_VERSION := v0.8.2
GOVULNCHECK_VERSION := v1.9.0
# govulncheck's database is built here, not fetched: the golang.org/x/vulndb module at this
# pseudo-version is the Go vulnerability database's snapshot of 2026-11-05 (its data/osv OSV
# entries), and its own cmd/indexdb, same version, writes them into the layout that
# govulncheck -db file:// reads (index/db.json, index/modules.json, ID/<id>.json) in bin/vulndb.
# Raise the version to take newer entries.
VULNDB_VERSION := v0.0.0-20261105234957-e22db6528018
STATICCHECK := $(BIN)/.staticcheck-$(STATICCHECK_VERSION)-$(GOVERSION)
GOVULNCHECK := $(BIN)/.govulncheck-$(GOVULNCHECK_VERSION)-$(GOVERSION)
INDEXDB     := $(BIN)/.indexdb-$(VULNDB_VERSION)
VULNDB      := $(BIN)/vulndb
VULNDB_STAMP := $(VULNDB)/.snapshot-$(VULNDB_VERSION)

# Debian packages that the tests, the demo, the benchmark and the chaos run start: the
# PostgreSQL server binaries (initdb, pg_ctl: throwaway clusters), Prometheus (the scrape test; its
# promtool checks and unit-tests the alert rules),
# PgBouncer (the transaction-pooling tests) and a C compiler (go test -race needs cgo). The demo
# asks only for the first.
DEPS_PACKAGES := postgresql prometheus pgbouncer gcc

.PHONY: help
help: ## Show this help.
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-20s\033[0m %s\n", $$1, $$2}'

$(TEMPORAL):
	@echo "building the temporal CLI $(TEMPORAL_CLI_VERSION) into bin/ (about 5 minutes, once)"
	GOBIN=$(BIN) $(GO) install github.com/temporalio/cli/cmd/temporal@$(TEMPORAL_CLI_VERSION)

.PHONY: temporal-cli
temporal-cli: $(TEMPORAL) ## Build the Temporal CLI (dev server) into bin/ if missing.

$(JAEGER): tools/jaeger/go.mod
	@echo "building Jaeger v2 (tools/jaeger pins the version) into bin/ (about 4 minutes, once)"
	cd tools/jaeger && GOWORK=off $(GO) build -o $(JAEGER) github.com/jaegertracing/jaeger/cmd/jaeger

.PHONY: jaeger
jaeger: $(JAEGER) ## Build Jaeger v2 (trace backend for demo-traces and the tests) into bin/ if missing.

# Each check looks where the code does (internal/pgtest, internal/obstest): the variable if set
# (PG_BINDIR, PROMETHEUS_BIN, PGBOUNCER; CC, the C compiler cgo runs for -race), else PATH, else
# Debian's install path.
.PHONY: deps
deps: ## Install the Debian packages the tests and demo run (postgresql prometheus pgbouncer gcc) if missing, or say the command.
	@has_postgresql() { if [ -n "$${PG_BINDIR:-}" ]; then [ -x "$$PG_BINDIR/initdb" ]; else command -v initdb || compgen -G '/usr/lib/postgresql/*/bin/initdb'; fi; } >/dev/null; \
	has_prometheus() { if [ -n "$${PROMETHEUS_BIN:-}" ]; then [ -x "$$PROMETHEUS_BIN" ]; else command -v prometheus; fi; } >/dev/null; \
	has_pgbouncer()  { if [ -n "$${PGBOUNCER:-}" ]; then [ -x "$$PGBOUNCER" ]; else command -v pgbouncer || [ -x /usr/sbin/pgbouncer ]; fi; } >/dev/null; \
	has_gcc()        { command -v "$${CC:-gcc}"; } >/dev/null; \
	missing() { for p in $(DEPS_PACKAGES); do has_$$p || echo -n "$$p "; done; }; \
	m=$$(missing); \
	if [ -n "$$m" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing the Debian packages: $$m"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq $$m >/dev/null || exit 1; \
		m=$$(missing); \
	fi; \
	if [ -n "$$m" ]; then \
		echo "missing: $$m(looked for through PG_BINDIR, PROMETHEUS_BIN, PGBOUNCER, CC, PATH, /usr/lib/postgresql/*/bin, /usr/sbin). Run:"; \
		echo "  sudo apt-get install -y $$m"; \
		exit 1; \
	fi; \
	if [ "$$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then \
		echo "creating the postgres OS user (initdb refuses to run as root)"; \
		useradd --system --home /var/lib/postgresql --shell /bin/bash postgres; \
	fi

.PHONY: demo
demo: $(TEMPORAL) ## Run the main job: transfers with injected redeliveries, on a throwaway PostgreSQL cluster and Temporal dev server.
	@$(MAKE) --no-print-directory deps DEPS_PACKAGES=postgresql
	$(GO) run ./cmd/demo $(DEMO_FLAGS)

.PHONY: demo-traces
demo-traces: $(TEMPORAL) $(JAEGER) ## The demo with Jaeger beside it (built once, about 4 minutes): prints a trace link and what Jaeger holds, then serves it until Ctrl-C.
	@$(MAKE) --no-print-directory deps DEPS_PACKAGES=postgresql
	$(GO) run ./cmd/demo -traces -hold $(DEMO_FLAGS)

.PHONY: test
test: deps $(TEMPORAL) $(JAEGER) ## Run all tests (race detector) against real PostgreSQL and a real Temporal dev server.
	$(GO) test -race -count=1 -timeout 30m $(PKGS)

.PHONY: bench
bench: deps $(TEMPORAL) ## Benchmarks: dedupactivity vs bare / the seed recipe / status-record / check-then-insert; writes docs/bench.md and docs/bench.png.
	$(GO) run ./cmd/bench $(BENCH_FLAGS)

.PHONY: bench-instructions
bench-instructions: deps ## Instructions per event, client and server, counted by valgrind; BENCH_ROWS="row;row" picks rows, RUNS=3 repeats each (the client count varies by run).
	cmd/bench/instructions.sh $(if $(BENCH_ROWS),"$(BENCH_ROWS)")

.PHONY: chaos
chaos: deps $(TEMPORAL) ## Chaos run (~2 min): worker SIGKILLs, backend kills, redeliveries, a PostgreSQL restart; at the outbox: dropped responses, relays killed before ack, two relays per message, destination outages. CHAOS_FLAGS for longer soaks.
	$(GO) run ./cmd/chaos $(CHAOS_FLAGS)

$(STATICCHECK):
	@echo "building staticcheck $(STATICCHECK_VERSION) into bin/ (under a minute, once)"
	@rm -f $(BIN)/.staticcheck-*
	GOBIN=$(BIN) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	@touch $@

$(GOVULNCHECK):
	@echo "building govulncheck $(GOVULNCHECK_VERSION) into bin/ (seconds, once)"
	@rm -f $(BIN)/.govulncheck-*
	GOBIN=$(BIN) $(GO) install golang.org/x/vuln/cmd/govulncheck@$(GOVULNCHECK_VERSION)
	@touch $@

$(INDEXDB):
	@echo "building the vulndb module's indexdb $(VULNDB_VERSION) into bin/ (under a minute, once)"
	GOBIN=$(BIN) $(GO) install golang.org/x/vulndb/cmd/indexdb@$(VULNDB_VERSION)
	@touch $@

$(VULNDB_STAMP): $(INDEXDB)
	@echo "writing the vulnerability database of golang.org/x/vulndb@$(VULNDB_VERSION) into bin/vulndb"
	rm -rf $(VULNDB)
	@# Downloaded from an empty directory, so that no go.sum or go.work.sum takes its dependencies.
	tmp=$$(mktemp -d); \
		dir=$$(cd $$tmp && GOWORK=off $(GO) mod download -json golang.org/x/vulndb@$(VULNDB_VERSION) | sed -n 's/^\t"Dir": "\(.*\)",$$/\1/p'); \
		rmdir $$tmp; \
		test -d "$$dir/data/osv" && $(BIN)/indexdb -vulns "$$dir/data/osv" -out $(VULNDB)
	@touch $@

.PHONY: lint-tools
lint-tools: $(STATICCHECK) $(GOVULNCHECK) $(VULNDB_STAMP) ## Build staticcheck, govulncheck and the vulnerability database into bin/ if missing.

.PHONY: vulncheck
vulncheck: $(GOVULNCHECK) $(VULNDB_STAMP) ## govulncheck on the pinned database: fails on a reachable vulnerability in a required module.
	@echo "govulncheck -db file://$(VULNDB) $(PKGS)  (full report: bin/govulncheck.txt)"
	@govulncheck -db file://$(VULNDB) $(PKGS) >$(BIN)/govulncheck.txt 2>&1; rc=$$?; \
	if [ $$rc -ne 0 ] && [ $$rc -ne 3 ]; then cat $(BIN)/govulncheck.txt; exit $$rc; fi; \
	awk -v gover="$(GOVERSION)" ' \
		/^=== Package Results/ { exit } \
		/^Vulnerability #/ { id = $$3 } \
		/^  Module: /          { std = 0 } \
		/^  Standard library/  { std = 1 } \
		/^    Found in: /      { found = $$3 } \
		/^    Fixed in: /      { printf "  %s  %-50s fixed in %s\n", id, found, $$3; if (std) nstd++; else nmod++ } \
		END { \
			if (nstd) printf "%d reachable in the standard library of %s: fixed by a newer Go, reported, not failed\n", nstd, gover; \
			if (nmod) { printf "%d reachable in required modules: upgrade them (go get MODULE@FIXED)\n", nmod; exit 1 } \
			print "no reachable vulnerability in a required module" \
		}' $(BIN)/govulncheck.txt

.PHONY: lint
lint: $(STATICCHECK) ## gofmt, go vet, staticcheck and govulncheck (tools built into bin/ at pinned versions).
	@out=$$("$$($(GO) env GOROOT)/bin/gofmt" -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	staticcheck $(PKGS)
	@$(MAKE) --no-print-directory vulncheck

.PHONY: fuzz
fuzz: ## Short fuzz runs of identity encoding, input fingerprinting and stored-result reading (FUZZTIME executions each).
	$(GO) test ./dedupactivity -run '^$$' -fuzz FuzzIdentityEncode -fuzztime $(FUZZTIME)
	$(GO) test ./dedupactivity -run '^$$' -fuzz FuzzFingerprint -fuzztime $(FUZZTIME)
	$(GO) test ./dedupactivity -run '^$$' -fuzz FuzzUnmarshalPayload -fuzztime $(FUZZTIME)
