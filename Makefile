# Each target sets itself up from nothing: virtual environment, Kafka jars, the local broker.
VENV := .venv
BIN := $(VENV)/bin
# Everything the local services and the chDB store write lives in the checkout (git ignores it).
export RLPULSE_HOME ?= $(CURDIR)/.rlpulse

.PHONY: demo test bench services-up services-down

$(VENV)/.installed: pyproject.toml
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

test: services-up
	$(BIN)/python -m pytest -v -rs tests

bench: services-up
	$(BIN)/python bench/run.py
