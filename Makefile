# eyas: `make demo` runs the pipeline on the tiny target; `make test` runs the tests.
# Both create the virtual environment and install everything on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# the browser test drives the Prefect UI with Debian's Chromium (as root, e.g. in CI, the install step
# apt-installs it when missing; Playwright's own browser downloads are not used)
CHROMIUM := /usr/bin/chromium

.PHONY: demo test install target bench clean-demo

$(STAMP): pyproject.toml $(wildcard kits/*.txt)
	test -x $(CHROMIUM) || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(BIN)/python scripts/kits.py install
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/eyas demo $(if $(APPROVE),--approve $(APPROVE))

test: $(STAMP)
	$(BIN)/ruff check eyas flows tasks eyas_cli tests scripts bench
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

target: $(STAMP)
	$(BIN)/python scripts/build_tiny_target.py --out fixtures/tiny-target
	$(BIN)/python scripts/build_tiny_kimi_target.py --out fixtures/tiny-kimi-target

clean-demo:
	rm -rf runs/demo
