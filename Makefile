# Two entry points: `make demo` (the main job on an embedded corpus) and `make test` (the test suite).
# Both create the virtual environment in .venv and install what they need, and .venv-hf: current transformers,
# where the folders of `convert.py export-to-hub` are loaded (tests/test_hub_export.py, the demo's last step).

PYTHON ?= python3
VENV ?= .venv
# The CPU build of PyTorch that lies on this disk; on a GPU machine pass e.g. TORCH_SPEC="torch==2.13.0"
# with your CUDA index, or TORCH_SPEC= to keep a torch you installed yourself.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.txl_dist-installed
# Current transformers, pinned, in an environment of its own without txl_dist (the test extra keeps 4.37.2, the
# last release with TransfoXL, for the peer tests).
HF_VENV ?= .venv-hf
HF_SPEC := transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 huggingface-hub==2.4.0
HF_STAMP := $(HF_VENV)/.installed-$(subst ==,-,$(firstword $(HF_SPEC)))

# CPU runs: DeepSpeed's CPU accelerator, one OpenMP thread per rank (ZeRO-3 is ~5x slower without it).
CPU_ENV := DS_ACCELERATOR=cpu OMP_NUM_THREADS=1

.PHONY: venv hf-venv tf-extra warm lint format test test-quick demo clean-demo clean gpu-check cluster-packages

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an open range would pull a multi-GB CUDA build.
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# The tf extra in .venv: TensorFlow's checkpoint reader, for the conversion of the authors' released models and its
# tests (tests/test_tf_release.py, in the hf tier); make test-quick and the demo do without it.
TF_STAMP := $(VENV)/.txl_dist-tf-installed
tf-extra: $(TF_STAMP)

$(TF_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[test,tf]"
	touch $@

hf-venv: $(HF_STAMP)

$(HF_STAMP):
	test -x $(HF_VENV)/bin/python || $(PYTHON) -m venv $(HF_VENV)
	# torch first and pinned, as above; then transformers and its tokenizer and weight readers, pinned.
	if [ -n "$(TORCH_SPEC)" ]; then $(HF_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(HF_VENV)/bin/python -m pip install -q $(HF_SPEC)
	touch $@

# DeepSpeed compiles its shared-memory communication op on first use (30-70 s); build it once here, into this
# environment's own cache ($(VENV)/torch_extensions, with its own ninja: txl_dist.rendezvous.process_group), so that no
# launch compiles, whatever PATH a node gives its ranks.
warm: venv
	$(CPU_ENV) $(BIN)/python -m txl_dist.rendezvous.process_group

# ruff, pinned in the test extra, configured in pyproject.toml: lint errors and unformatted files both fail.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Rewrites the files in place: what `make lint` asks for.
format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The full suite: the quick tier on every core (pytest-xdist), then the tiers that start launchers, the cluster
# and .venv-hf, one test at a time (they hold ports, the one test cluster and the CPU's two cores themselves), with
# the slowest tests of each at the end; fails when either part fails. cluster-packages: the Debian packages of the
# real two-node Slurm cluster that tests/cluster/ builds (root only).
QUICK := not launcher and not cluster and not hf
SLOW := launcher or cluster or hf
# Workers for the quick tier: one per core by default; TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= auto
test: cluster-packages warm hf-venv tf-extra
	status=0; \
	$(CPU_ENV) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=10 -m "$(QUICK)" tests || status=$$?; \
	$(CPU_ENV) TXL_HF_PYTHON=$(abspath $(HF_VENV))/bin/python $(BIN)/python -m pytest -q --durations=20 \
		-m "$(SLOW)" tests || status=$$?; \
	exit $$status

# The quick tier: every test that starts no launcher, no cluster and no .venv-hf (markers in each slow file or test;
# docs/architecture.md, Tests), on every core. Needs only .venv (and its compiled DeepSpeed op).
test-quick: warm
	$(CPU_ENV) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=10 -m "$(QUICK)" tests

# Debian packages of the two-node test cluster (tests/cluster: Slurm, munge, sshd per node, pdsh, mpirun), installed
# when missing and when run as root; does nothing when all are present or when not root (the cluster tests then
# skip, or fail on CI).
CLUSTER_PACKAGES := slurm-wlm munge openssh-server openssh-client pdsh iproute2 util-linux procps openmpi-bin
cluster-packages:
	@missing=$$(for package in $(CLUSTER_PACKAGES); do \
		dpkg-query -W -f='$${Status}\n' $$package 2>/dev/null | grep -q ' installed$$' || echo $$package; done); \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "cluster-packages: not root, not installing:" $$missing; \
	else apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; fi

# The main job on an embedded corpus: the Penn Treebank of the `treebank` package -> a word tokenizer and shards
# -> a small Transformer-XL trained on 2 CPU ranks through the deepspeed launcher -> its curves (demo/curves.png)
# -> test perplexity, an export folder and a generated sample -> a folder for current transformers, sampled there
# with the three lines of docs/transformers.md (Loading a folder).
# Rerunning resumes (or finds the run finished); `make clean-demo` starts over.
DEMO ?= demo
DEMO_TRAIN ?=
# bf16 where the CPU multiplies bf16 natively (AMX or AVX512-BF16): the same perplexity as fp32 at every step,
# more tokens/s (docs/demo.md, What it gives: the measured ratio); elsewhere bf16 is emulated and slower, so fp32.
DEMO_PRECISION ?= $(shell grep -qwE 'amx_bf16|avx512_bf16' /proc/cpuinfo 2>/dev/null && echo bf16 || echo fp32)
define HUB_SNIPPET
from transformers import AutoModelForCausalLM, AutoTokenizer
model, tokenizer = AutoModelForCausalLM.from_pretrained("$(DEMO)/hub", trust_remote_code=True), AutoTokenizer.from_pretrained("$(DEMO)/hub", trust_remote_code=True)
print(tokenizer.decode(model.generate(**tokenizer("the company said", return_tensors="pt"), max_new_tokens=40, do_sample=True, top_p=0.9)[0]))
endef
export HUB_SNIPPET
demo: warm hf-venv
	$(BIN)/python -m data_tools.train_tokenizer --kind word --format ptb --output $(DEMO)/tokenizer --overwrite --no-progress
	$(BIN)/python -m data_tools.build_shards --tokenizer $(DEMO)/tokenizer --output $(DEMO)/shards --format ptb \
		--workers 2 --overwrite --no-progress
	$(CPU_ENV) $(BIN)/deepspeed --num_gpus 2 launchers/train.py --config configs/ptb_small.yaml \
		data.shards=$(DEMO)/shards data.tokenizer=$(DEMO)/tokenizer train.output_dir=$(DEMO)/run \
		precision.dtype=$(DEMO_PRECISION) $(DEMO_TRAIN)
	$(BIN)/python -m txl_dist.plot $(DEMO)/run --out $(DEMO)/curves.png
	$(BIN)/python launchers/evaluate.py $(DEMO)/run --split test --output $(DEMO)/test.json
	$(BIN)/python launchers/convert.py zero-to-export $(DEMO)/run $(DEMO)/export --overwrite
	$(BIN)/python launchers/generate.py $(DEMO)/export --prompt "the company said" --max-new-tokens 40 --seed 1
	$(BIN)/python launchers/convert.py export-to-hub $(DEMO)/export $(DEMO)/hub --overwrite
	$(HF_VENV)/bin/python -I -c "$$HUB_SNIPPET"
	@echo "curves: $(DEMO)/curves.png; TensorBoard: $(BIN)/tensorboard --logdir $(DEMO)/run/tensorboard"

# One check of the CUDA paths on one NVIDIA GPU, under 8 minutes, ending with one JSON line (figures also in
# gpu_check/): CUDA-only tests, fused vs reference attention, host syncs per step, lm1b_base throughput and
# memory, 1-GPU training runs, generation. Uses .venv when it exists (on a GPU machine build it with your CUDA
# torch: make venv TORCH_SPEC=), else python3 with torch, deepspeed and webdataset importable. Without CUDA it
# says so and exits 0.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py --out gpu_check

clean-demo:
	rm -rf $(DEMO)

clean:
	rm -rf $(VENV) $(HF_VENV) .pytest_cache build *.egg-info
