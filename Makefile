# Two entry points: `make demo` (the main job on an embedded corpus) and `make test` (the test suite).
# Both create the virtual environment in .venv and install what they need.

PYTHON ?= python3
VENV ?= .venv
# The CPU build of PyTorch that lies on this disk; on a GPU machine pass e.g. TORCH_SPEC="torch==2.13.0"
# with your CUDA index, or TORCH_SPEC= to keep a torch you installed yourself.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.txl_dist-installed

# CPU runs: DeepSpeed's CPU accelerator, one OpenMP thread per rank (ZeRO-3 is ~5x slower without it).
CPU_ENV := DS_ACCELERATOR=cpu OMP_NUM_THREADS=1

.PHONY: venv warm test clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an open range would pull a multi-GB CUDA build.
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# DeepSpeed compiles its shared-memory communication op on first use (30-45 s, cached in
# ~/.cache/torch_extensions); build it once here so no test pays for it.
warm: venv
	$(CPU_ENV) $(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"

test: warm
	$(CPU_ENV) $(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
