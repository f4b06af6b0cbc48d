# The two commands of the README:
#   make demo   - runs the main job (MiniLM embeddings, SPMD scan, checks)
#   make test   - runs the test suite (4 virtual devices, then the SPMD tests on 1 and 8), then
#                 make test-jax-only and make test-transformers-low
#                 The first run is spread over pytest-xdist workers, one per core (nproc; at most
#                 PYTEST_MAX_WORKERS, default 4; PYTEST_WORKERS=0 runs it in one process), each module
#                 whole on one worker (--dist loadfile: its module-scoped fixtures, such as the torchrun
#                 and multiprocess references, built once). The four smaller runs (make test-spmd-1,
#                 test-spmd-8, test-jax-only, test-transformers-low) then run as many at once as there
#                 are workers, one process each (each alone keeps about 1.3 cores busy; xdist would add
#                 a collection and the imports per worker), each run's output printed when it ends; the
#                 longest first (spmd on 8 devices; jax-only and transformers-low about as long; spmd on 1
#                 the shortest), so that the two lanes end about together.
# Both create .venv when it is missing (or pyproject.toml changed) and reuse it otherwise.
#   make test-jax-only - the executor and planner tests in .venv-jax: jax 0.11.2 (the top of the
#                 tested range, the GPU machine's version) and no torch, torch_xla or torchax, which
#                 proves the import rule. jax 0.11 needs Python >= 3.12: PYTHON_JAX names one, else
#                 the first python3.12 / 3.13 / 3.14 found (on PATH or under ~/.pyenv/versions).
#   make test-transformers-low - the tests that build Hugging Face models on transformers 5.17.0, the
#                 bottom of pyproject.toml's range (.venv has the newest): that version alone, with the
#                 huggingface_hub / httpx it needs at other versions than .venv's, installed without
#                 dependencies into .venv-tf-low (about 130 MB) and put first on PYTHONPATH over .venv.
PY := .venv/bin/python
JAX_PY := .venv-jax/bin/python
# The CPU set of `make venv`: jax 0.10.2, the bottom of pyproject.toml's tested range.
CPU_PINS := jax==0.10.2 jaxlib==0.10.2
JAX_ONLY_PKGS := jax==0.11.2 jaxlib==0.11.2 numpy ml_dtypes pytest hypothesis pytest-xdist
# The bottom of the transformers range and what it pins apart from .venv's (pip check verifies the set).
TF_LOW := 5.17.0
TF_LOW_PKGS := transformers==$(TF_LOW) 'huggingface_hub>=1.5,<2' 'httpx<1' 'httpcore<2'
# What depends on the model code: every family exact or refused, the experts interface, greedy generation
# (the cache API); not the stack's own variants (sorted experts, FSDP, tied routers), which .venv runs.
TF_LOW_TESTS := tests/hf/test_transformers_range.py tests/hf/test_hf_families.py \
	tests/hf/test_generate.py
TF_LOW_SELECT := transformers_range or test_family_matches_torch or refused_at_construction or experts_forms_equal_eager \
	or bf16_router or greedy_equals_hf
export PJRT_DEVICE := CPU
# One pytest-xdist worker per core this process may run on (nproc counts taskset's set; xdist's own
# -n auto counts the machine's cores when psutil is installed), at most PYTEST_MAX_WORKERS.
PYTEST_MAX_WORKERS ?= 4
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt $(PYTEST_MAX_WORKERS) ] && n=$(PYTEST_MAX_WORKERS); echo $$n)
XDIST := -n $(PYTEST_WORKERS)
# How many of the four smaller runs of make test run at once: one per worker (1 with PYTEST_WORKERS=0).
STAGE_JOBS := $(if $(filter 0,$(PYTEST_WORKERS)),1,$(PYTEST_WORKERS))
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-spmd-1 test-spmd-8 test-jax-only test-transformers-low venv venv-jax venv-tf-low

venv: .venv/.installed

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[examples,test]' $(CPU_PINS)
	touch $@

venv-jax: .venv-jax/.installed

.venv-jax/.installed: Makefile
	@test -x $(JAX_PY) || { \
	  py="$(PYTHON_JAX)"; \
	  if [ -z "$$py" ]; then \
	    for c in python3.12 python3.13 python3.14 $$HOME/.pyenv/versions/3.1[234]*/bin/python3; do \
	      if $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then py=$$c; break; fi; \
	    done; \
	  fi; \
	  if [ -z "$$py" ]; then \
	    echo "make test-jax-only: jax 0.11.2 needs Python >= 3.12 and none was found; set PYTHON_JAX=/path/to/python3.12" >&2; \
	    exit 1; \
	  fi; \
	  echo "creating .venv-jax with $$py"; \
	  $$py -m venv .venv-jax; }
	$(JAX_PY) -m pip install -q --upgrade pip
	$(JAX_PY) -m pip install -q $(JAX_ONLY_PKGS)
	touch $@

venv-tf-low: .venv-tf-low/.installed

.venv-tf-low/.installed: Makefile .venv/.installed
	rm -rf .venv-tf-low
	$(PY) -m pip install -q --no-deps --target .venv-tf-low $(TF_LOW_PKGS)
	PYTHONPATH=.venv-tf-low $(PY) -m pip check
	touch $@

demo: venv
	$(PY) examples/minilm_embed.py

test: venv
	XLA_SWAP_NUM_DEVICES=4 $(PY) -m pytest -q $(XDIST) --dist loadfile --durations=20 tests
	$(MAKE) --no-print-directory -j$(STAGE_JOBS) --output-sync=target STAGE_XDIST= \
	  test-spmd-8 test-jax-only test-transformers-low test-spmd-1

# The tests marked spmd on 1 and on 8 virtual devices. STAGE_XDIST: these runs' workers (make test runs
# them side by side, one process each); alone, one per core.
STAGE_XDIST ?= $(XDIST) --dist load
test-spmd-1 test-spmd-8: test-spmd-%: venv
	XLA_SWAP_NUM_DEVICES=$* $(PY) -m pytest -q $(STAGE_XDIST) -m spmd tests

# tests/executors minus the modules that need torch (they importorskip it), and tests/planning.
test-jax-only: venv-jax
	$(JAX_PY) -c 'import importlib.util as u, sys; bad = [m for m in ("torch", "torch_xla", "torchax") if u.find_spec(m)]; sys.exit(f"{bad} installed in .venv-jax" if bad else 0)'
	XLA_SWAP_NUM_DEVICES=4 $(JAX_PY) -m pytest -q $(STAGE_XDIST) tests/executors tests/planning

# test_transformers_range.py fails unless transformers $(TF_LOW) is the one imported.
test-transformers-low: venv venv-tf-low
	PYTHONPATH=.venv-tf-low XLA_SWAP_TRANSFORMERS=$(TF_LOW) XLA_SWAP_NUM_DEVICES=4 $(PY) -m pytest -q $(STAGE_XDIST) $(TF_LOW_TESTS) \
	  -k '$(TF_LOW_SELECT)'
