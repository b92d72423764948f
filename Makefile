# The two commands of the README's quick start. Both set up what they need, idempotently.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test setup models bench clean

setup: $(STAMP)

# torch is pinned and installed first: 2.13.0's CPU build lies on local disk, anything else
# would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

models: $(STAMP)
	$(VENV)/bin/starsd models fetch

demo: models
	$(VENV)/bin/starsd launch --targets 2 --limit 4 --max-new-tokens 64 --json-out results/demo.json

test: models
	$(PY) -m pytest -q

bench: models
	$(VENV)/bin/starsd bench colocated --prompts humaneval --limit 16 --json-out results/colocated.json

clean:
	rm -rf $(VENV) results
