# Each target sets itself up from nothing: virtual environment, Kafka jars, the local broker.
VENV := .venv
BIN := $(VENV)/bin
# Everything the local services and the chDB store write lives in .rlpulse/ in the checkout (git
# ignores it): rlpulse run from a checkout picks that home itself (rlpulse.base.files), so `make` and
# a bare `.venv/bin/rlpulse` share one broker and one store. RLPULSE_HOME overrides it for both.

.PHONY: demo lint test test-all test-containers test-scale bench soak services-up services-down browser tools

$(VENV)/.installed: pyproject.toml setup.py schemas/_blockdecode.pyx schemas/_blockencode.pyx schemas/_avroops.pxi
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

services-up: $(VENV)/.installed
	$(BIN)/rlpulse services up

services-down: $(VENV)/.installed
	$(BIN)/rlpulse services down

demo: services-up
	$(BIN)/rlpulse demo

# The HTML report tests render the page in Debian's headless Chromium; install it where we may.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium is not installed (needs root and apt): the HTML report tests will be skipped"

# Everything the full suite drives besides Python: chromium (browser) and tmux (the live view of
# `rlpulse watch`). Missing, their tests skip; under CI=true they fail.
tools: browser
	@command -v tmux >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >/dev/null; } || \
		echo "tmux is not installed (needs root and apt): the tests of the live watch view will be skipped"

# ruff over the repository; mypy over the installed packages; then the import-layer check (tests/layers.py:
# no room imports a room above or beside it, no circles). mypy cannot follow the editable
# install's import hook (rlpulse.producers lives in producers/), so it reads a tree of links
# laid out as installed, in .cache/ (git ignores it).
MYPY_TREE := .cache/mypy-tree
lint: $(VENV)/.installed
	@test -x $(BIN)/ruff -a -x $(BIN)/mypy || $(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/ruff check .
	@rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/rlpulse && \
		for p in base schemas producers streams sinks; do ln -s ../../../$$p $(MYPY_TREE)/rlpulse/$$p; done && \
		for f in rlpulse/*.py; do ln -s ../../../$$f $(MYPY_TREE)/rlpulse/; done
	cd $(MYPY_TREE) && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p rlpulse
	$(BIN)/python -m tests.layers

# PYTEST_ARGS: more pytest options, e.g. make test PYTEST_ARGS="-x -k pipeline".
PYTEST := $(BIN)/python -m pytest -v -rs --durations=5

# The fast tier, at most 6 minutes on 2 cores: unit tests, then every component through the real
# broker and the real ClickHouse engine (SDK to broker, every figure and alert rule through
# `rlpulse streams`, the sink and its dead letters, saved queries and the read endpoint, the alert
# feed, the CLI's errors). Tests marked `full` (faults, scale, cluster, security, browser,
# terminal) run in `make test-all`.
test: services-up
	$(PYTEST) -m "not full" $(PYTEST_ARGS) tests/unit tests/integration

# Everything (CI runs it; under 30 minutes here).
test-all: services-up tools
	$(PYTEST) $(PYTEST_ARGS) tests/unit tests/integration

# The integration tests again against Kafka and ClickHouse server containers (testcontainers;
# needs a Docker engine), and the tests that need a ClickHouse server container of their own.
test-containers: $(VENV)/.installed
	$(PYTEST) --backend=containers $(PYTEST_ARGS) tests/integration

# The scale-out tests alone (three streams workers with one SIGKILLed and one added, two sinks
# in one group), printing the partitions each worker held and the recovery times measured.
# Each takes 2-3 minutes: `make test-all` runs them, `make test` does not.
test-scale: services-up
	$(BIN)/python -m pytest -v -rs -s tests/integration/rlpulse/test_scale_workers.py tests/integration/rlpulse/test_scale_sinks.py

# BENCH_ARGS: options of bench/run.py, e.g. make bench BENCH_ARGS=--quick. py-spy (for the
# profiles) is installed into the venv here; without it the bench runs and says so.
bench: services-up
	@test -x $(BIN)/py-spy || $(BIN)/pip install --quiet py-spy || echo "py-spy could not be installed: no profiles"
	$(BIN)/python bench/run.py $(BENCH_ARGS)

# The soak (bench/soak.py): a live load at half the bench's drain rate for 10 minutes, RSS and
# lag sampled, ClickHouse compared with the truth; not part of `make test`. SOAK_ARGS: its
# options, e.g. make soak SOAK_ARGS="--minutes 2".
soak: services-up
	$(BIN)/python bench/soak.py $(SOAK_ARGS)
