# Two entry points: `make run` (gateway + simulated fleet) and `make test` (lint + tests).
# Both create .venv and install kvgate into it on first use, so they work on a fresh clone.
VENV ?= .venv
STAMP := $(VENV)/.installed-stamp

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip 'setuptools>=77'
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

.PHONY: setup run test browser

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvgate serve $(if $(CONFIG),--config $(CONFIG))

# Headless Chromium for the page tests (status page, control-plane docs); best effort: without it
# those tests skip. It is Debian's package, installed with apt-get (root, a network mirror); say
# SKIP_BROWSER=1 to leave the system alone.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo "make browser: installing Debian's chromium with apt-get for the page tests (SKIP_BROWSER=1 skips)"; \
		apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	} || echo "chromium not installed: the page tests will be skipped"

# The suites of the hand-written HTTP server and client run first, under coverage, which must hold
# the floor in pyproject.toml ([tool.coverage.report]); the rest of the suite runs without it. Both
# in two worker processes, a test file to each at a time (module fixtures stay in one process): most
# tests wait on real processes and sockets, so two workers take about half the time, even on two cores.
XDIST := -n 2 --dist loadfile
HTTP_TESTS := tests/http tests/path/test_transports.py tests/path/test_http1_protocol.py \
	tests/path/test_upstream_hostile.py tests/path/test_upstream_hostile_cases.py

test: $(STAMP) $(if $(SKIP_BROWSER),,browser)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/python docs/check_links.py
	$(VENV)/bin/pytest -q $(XDIST) --cov --cov-report=term-missing:skip-covered $(HTTP_TESTS)
	$(VENV)/bin/pytest -q $(XDIST) $(addprefix --ignore=,$(HTTP_TESTS))
