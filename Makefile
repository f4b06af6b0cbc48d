# The two commands of the README:
#   make demo   - runs the main job (MiniLM embeddings, SPMD scan, checks)
#   make test   - runs the test suite (4 virtual devices, then the SPMD tests on 1 and 8)
# Both create .venv when it is missing (or pyproject.toml changed) and reuse it otherwise.
PY := .venv/bin/python
export PJRT_DEVICE := CPU
export PYTHONUNBUFFERED := 1

.PHONY: demo test venv

venv: .venv/.installed

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[examples,test]'
	touch $@

demo: venv
	$(PY) examples/minilm_embed.py

test: venv
	XLA_SWAP_NUM_DEVICES=4 $(PY) -m pytest -q tests
	XLA_SWAP_NUM_DEVICES=1 $(PY) -m pytest -q -m spmd tests
	XLA_SWAP_NUM_DEVICES=8 $(PY) -m pytest -q -m spmd tests
