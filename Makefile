# Two entry points: `make run` (gateway + simulated fleet) and `make test` (lint + tests).
# Both create .venv and install kvgate into it on first use, so they work on a fresh clone.
VENV ?= .venv
STAMP := $(VENV)/.installed-stamp

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip 'setuptools>=77'
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

.PHONY: setup run test test-compiled browser

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
# the floor in pyproject.toml ([tool.coverage.report]); the rest of the suite runs without it.
HTTP_TESTS := tests/http tests/path/test_transports.py tests/path/test_http1_protocol.py \
	tests/path/test_upstream_hostile.py tests/path/test_upstream_hostile_cases.py

test: $(STAMP) $(if $(SKIP_BROWSER),,browser)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/python docs/check_links.py
	$(VENV)/bin/pytest -q --cov --cov-report=term-missing:skip-covered $(HTTP_TESTS)
	$(VENV)/bin/pytest -q $(addprefix --ignore=,$(HTTP_TESTS))

# The hot path's modules (gateway/build.py) compiled by mypyc from the same source, in a copy of the
# tree (extensions beside the sources here would shadow the edits made to them), and the HTTP
# suites, the request path's and routing's suites and the build check run against them. Not part
# of `make test` while the compiled build is opt-in: on a loaded 2-core machine the suite took 5.5
# min and this target 3 more (build 1, tests 2), past CI's 8.
COMPILED_TREE := build/compiled-tree
COMPILED_TESTS := tests/http tests/path tests/routing tests/test_build.py tests/observe/test_metrics.py

test-compiled: $(STAMP)
	rm -rf $(COMPILED_TREE) && mkdir -p $(COMPILED_TREE)
	git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C $(COMPILED_TREE)
	cd $(COMPILED_TREE) && KVGATE_COMPILE=1 $(abspath $(VENV))/bin/python setup.py -q build_ext --inplace
	cd $(COMPILED_TREE) && PYTHONPATH=$(abspath $(COMPILED_TREE)) KVGATE_EXPECT_BUILD=compiled \
		$(abspath $(VENV))/bin/pytest -q -p no:cacheprovider $(COMPILED_TESTS)
