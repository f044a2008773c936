# Two entry points: `make run` (gateway + simulated fleet) and `make test` (lint + tests).
# Both create .venv and install kvgate into it on first use, so they work on a fresh clone.
VENV ?= .venv
STAMP := $(VENV)/.installed-stamp

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

.PHONY: setup run test browser

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvgate serve $(if $(CONFIG),--config $(CONFIG))

# Headless Chromium for the status-page test; best effort: without it that one test skips.
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
		|| echo "chromium not installed: the dashboard browser test will be skipped"

test: $(STAMP) browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q
