# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DATA   := data/synthetic

.PHONY: demo test clean

$(VENV)/.runtime-installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(VENV)/.dev-installed: $(VENV)/.runtime-installed requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

demo: $(VENV)/.runtime-installed
	$(PY) -m datasets.synthetic --out $(DATA)
	$(PY) train.py --config configs/quickstart.yaml
	$(PY) eval.py --checkpoint runs/quickstart/latest/checkpoints/best.pt --split val
	$(PY) infer_chunked.py --checkpoint runs/quickstart/latest/checkpoints/best.pt \
		--input $(DATA)/long.jsonl --chunk 16 --overlap 4 --timeline --max-videos 1

test: $(VENV)/.dev-installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

clean:
	rm -rf runs $(DATA) data/long_range
