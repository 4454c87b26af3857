.DEFAULT_GOAL := help
SHELL := /bin/bash

GO        ?= go
BIN       := $(CURDIR)/bin
TEMPORAL  := $(BIN)/temporal
TEMPORAL_CLI_VERSION := v1.5.1
JAEGER    := $(BIN)/jaeger
# Every package of both modules of the workspace (go.work): the library and
# example (.), and the tooling (./cmd), whose dependencies users do not get.
PKGS      := ./... ./cmd/...
export PATH := $(BIN):$(PATH)

.PHONY: help
help: ## Show this help.
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-13s\033[0m %s\n", $$1, $$2}'

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

.PHONY: demo
demo: $(TEMPORAL) ## Run the main job: transfers with injected redeliveries on embedded PostgreSQL + Temporal.
	$(GO) run ./cmd/demo $(DEMO_FLAGS)

.PHONY: demo-traces
demo-traces: $(TEMPORAL) $(JAEGER) ## The demo with Jaeger beside it: prints a trace link and what Jaeger holds, then serves it until Ctrl-C.
	$(GO) run ./cmd/demo -traces -hold $(DEMO_FLAGS)

.PHONY: test
test: $(TEMPORAL) $(JAEGER) ## Run all tests (race detector) against real PostgreSQL and a real Temporal dev server.
	$(GO) test -race -count=1 -timeout 30m $(PKGS)

.PHONY: bench
bench: $(TEMPORAL) ## Benchmarks: dedupactivity vs bare / status-record / check-then-insert; writes docs/bench.md and docs/bench.png.
	$(GO) run ./cmd/bench $(BENCH_FLAGS)

.PHONY: chaos
chaos: $(TEMPORAL) ## Chaos run (~2 min): worker SIGKILLs, backend kills, redeliveries, a PostgreSQL restart; at the outbox: dropped responses, relays killed before ack, two relays per message, destination outages. CHAOS_FLAGS for longer soaks.
	$(GO) run ./cmd/chaos $(CHAOS_FLAGS)

.PHONY: lint
lint: ## gofmt and go vet.
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

.PHONY: fuzz
fuzz: ## Short fuzz runs of identity encoding and input fingerprinting.
	$(GO) test ./dedupactivity -run '^$$' -fuzz FuzzIdentityEncode -fuzztime 20s
	$(GO) test ./dedupactivity -run '^$$' -fuzz FuzzFingerprint -fuzztime 20s
