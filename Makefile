# Everything runs from a project-local virtualenv that this Makefile creates on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
JOB     ?= examples/local-small.yaml
OUT     ?= out
KILL    ?= 2@12   # the demo SIGKILLs server 2 twelve seconds into training; KILL= runs without a failure

.PHONY: demo test test-fast lint format proto bench clean help

help:
	@echo "make demo   - train examples/local-small.yaml locally with ECRec, kill a server mid-run;"
	@echo "              report and throughput plot under $(OUT)/"
	@echo "make test   - run the test suite"
	@echo "make lint   - ruff"
	@echo "make proto  - regenerate the gRPC stubs from services/ecrec/proto/ecrec.proto"
	@echo "make bench  - parameter-server benchmark (ecrec bench server)"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned in pyproject.toml (torch==2.13.0): the CPU wheel comes from local disk where present.
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ecrec local $(JOB) --out $(OUT) --report $(OUT)/report.json --plot $(OUT)/throughput.png \
		$(if $(strip $(KILL)),--kill $(strip $(KILL)))

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=10

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

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
