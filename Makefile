# Two entry points; each sets itself up (idempotently) in .venv.
#   make validate   run `ringcheck validate` on its built-in default
#   make test       run the test suites (all but the end-to-end command tests)
#   make test-cli   run the end-to-end command tests (those that start ringcheck or pytest in a subprocess)
#   make test-thorough  run the rest of the case grids whose covering subsets make test runs, and every
#                   property at its whole search (make test: at most 10 examples each); CI runs all three
#   make trainer-envs  build each trainer's own environment (.trainer-envs/) and run the --model check there
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ringcheck-installed

.PHONY: validate test test-cli test-thorough trainer-envs install clean

install: $(STAMP)

# torch: keep a torch the system already has (a GPU runner) by seeing the system
# site-packages; otherwise take the CPU wheel 2.13.0, never an unpinned (CUDA) download.
$(STAMP): pyproject.toml setup.py Makefile
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,triton,peers,docs,hf]"
	@touch $(STAMP)

validate: $(STAMP)
	$(VENV)/bin/ringcheck validate

# on pytest-xdist workers, one per core (the suites' local rings are processes of their own);
# with byte-code caches even where the environment turns them off (PYTHONDONTWRITEBYTECODE): the
# suites start about a hundred Python processes, each importing ringcheck (and pytest rewriting
# the test modules in each worker). Work stealing: a worker that runs out takes the other's pending
# tests (load scheduling left one worker up to 11 s of the tail alone). First the lint: ruff, with the
# rules in pyproject.toml.
# The end-to-end command tests (marker cli: each starts ringcheck or pytest as a user would, in a
# process of its own, importing torch again) are test-cli's; .ci/run runs both targets
test: $(STAMP)
	$(VENV)/bin/ruff check .
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest suites -q -n auto --dist worksteal -m "not cli and not thorough" --search-examples 10

test-cli: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest suites -q -n auto -m cli

# marker thorough: a grid's cases beyond its covering subset (every ring size, mode, placement and dtype
# is in make test at least once; these are the other combinations of them); and the property tests
# (marker hypothesis) again at the search profile's own count (make test: at most 10 examples each);
# CI runs it after make test-cli
test-thorough: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest suites -q -n auto -m "(thorough or hypothesis) and not cli"

# each trainer's environment at the transformers it pins (benchmarks/trainer_envs.py: one row a trainer;
# ENVS=oldest,verl picks some), ringcheck installed into it, the --model suites and step --model llama run there
trainer-envs: $(STAMP)
	$(PY) -m benchmarks.trainer_envs $(if $(ENVS),--env $(ENVS))

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
