# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DATA   := data/synthetic
# The exact versions the tests and the figures in bench/RESULTS.md use; empty (make test-latest) installs the newest releases.
CONSTRAINTS ?= constraints.txt
PIN    := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),--upgrade)

.PHONY: demo test test-latest clean

$(VENV)/.runtime-installed: requirements.txt $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt $(PIN)
	touch $@

$(VENV)/.dev-installed: $(VENV)/.runtime-installed requirements-dev.txt requirements-backbones.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt $(PIN)
	touch $@

demo: $(VENV)/.runtime-installed
	$(PY) -m datasets.synthetic --out $(DATA)
	$(PY) train.py --config configs/quickstart.yaml
	$(PY) eval.py --checkpoint runs/quickstart/latest/checkpoints/best.pt --split val
	$(PY) infer_chunked.py --checkpoint runs/quickstart/latest/checkpoints/best.pt \
		--input $(DATA)/long.jsonl --chunk 16 --overlap 4 --timeline --max-videos 1

test: $(VENV)/.dev-installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15 tests

# the same tests on the newest releases the package index serves, in a venv of their own
test-latest:
	$(MAKE) test VENV=.venv-latest CONSTRAINTS=

clean:
	rm -rf runs $(DATA) data/long_range data/task_* data/segmentation* features timelines timelines.jsonl timelines_frames.csv timelines_scores.json
