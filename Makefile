# nanorl: the two commands are `make demo` and `make test`; each sets itself up.
SHELL := /bin/bash
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3
# torch==2.13.0 (CPU) is pinned here; with your own CUDA torch already in $(VENV), use CONSTRAINTS=
CONSTRAINTS ?= constraints.txt
STAMP := $(VENV)/.nanorl-installed
# vLLM's CPU build (the extra `vllm`) on Linux x86-64 with the CPU torch pin, and then tests/test_vllm.py and the
# notebook cells flagged `vllm` run; `make setup VLLM=` leaves it out. Its image, audio and GPU-kernel companions do
# not match the CPU torch (vLLM then fails to import) and text needs none of them, so they are removed after it
VLLM ?= $(if $(CONSTRAINTS),$(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)))
VLLM_UNUSED := torchvision torchaudio torchcodec triton
comma := ,
EXTRAS := dev$(if $(VLLM),$(comma)vllm)
OFFLINE := HF_HUB_OFFLINE=1 WANDB_MODE=disabled OMP_NUM_THREADS=1
SNAPSHOT = find nanorl nbs -maxdepth 1 -type f \( -name '*.py' -o -name '*.ipynb' \) -print0 | sort -z | xargs -0 md5sum
# On a CPU with AVX-512 the tests marked `numerics` (tests/conftest.py: comparisons whose rounding depends on the CPU's
# kernels) run a second time on its AVX2 kernels, so that both instruction sets are tried where the machine has both
CPUINFO ?= /proc/cpuinfo
AVX512 := $(shell grep -m1 '^flags' $(CPUINFO) 2>/dev/null | grep -ow avx512f)
AVX2_KERNELS := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2

.PHONY: setup demo real gsm8k test test-fast export readme lab

$(STAMP): setup.py settings.ini $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[$(EXTRAS)]"
	$(if $(VLLM),$(BIN)/python -m pip uninstall -q -y $(VLLM_UNUSED))
	@touch $@

setup: $(STAMP)  ## create .venv and install nanorl with its dev tools (and vLLM's CPU build on Linux x86-64)

demo: $(STAMP)  ## the embedded default run on CPU
	$(BIN)/python -m nanorl.demo

real: $(STAMP)  ## the recorded SmolLM2-135M-Instruct run (18_real): 40 steps, 2 threads, 4.9 min on a 2-core Zen 5
	$(BIN)/python -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) gguf accelerate
	$(BIN)/python bench/smollm2.py
	$(BIN)/python -m nanorl.real --num-steps 40 --eval-examples 64 --threads 2

GSM8K_DATA ?= ../shared/data/gsm8k
gsm8k: $(STAMP)  ## the recorded GSM8K run (18_real): Qwen2.5-Coder-0.5B-Instruct, 30 steps on GSM8K train, 44 min on a 2-core Zen 5 (66-75 on a Zen 4)
	$(BIN)/python -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) gguf accelerate
	$(BIN)/python bench/qwen_coder.py
	$(BIN)/python -m nanorl.real --problems gsm8k --data-dir $(GSM8K_DATA) --threads 2 --output-dir runs/gsm8k

test: $(STAMP)  ## library in sync with notebooks, notebooks clean, notebooks run (saved outputs still true), pytest (numerics on AVX2 too)
	@before="$$($(SNAPSHOT))"; $(BIN)/nbdev_export; \
	 if [ "$$before" != "$$($(SNAPSHOT))" ]; then \
	   echo "FAIL: nbdev_export changed nanorl/: the library is out of sync with nbs/ (edit the notebooks, then run nbdev_export)"; exit 1; fi
	@before="$$($(SNAPSHOT))"; $(BIN)/nbdev_clean; \
	 if [ "$$before" != "$$($(SNAPSHOT))" ]; then \
	   echo "FAIL: nbdev_clean changed nbs/: run nbdev_clean and commit the result"; exit 1; fi
	$(OFFLINE) $(BIN)/python tests/notebooks.py --n_workers 2 --timing$(if $(VLLM), --flags vllm)
	@$(OFFLINE) $(BIN)/python -m pytest tests/ -q -p no:cacheprovider; rc=$$?; \
	 if [ $$rc = 5 ]; then echo "pytest: no tests collected"; rc=0; fi; exit $$rc
ifneq ($(AVX512),)
	@echo "AVX-512 CPU: the numerics tests again on its AVX2 kernels ($(AVX2_KERNELS))"
	@$(OFFLINE) $(AVX2_KERNELS) $(BIN)/python -m pytest tests/ -m numerics -q -p no:cacheprovider
else
	@echo "no AVX-512 on this CPU: the second pass of the numerics tests (on AVX2 kernels) is skipped, the machine has only one instruction set"
endif

test-fast: $(STAMP)  ## the loop while editing: pytest without the tests marked slow (tests/conftest.py), no notebooks
	$(BIN)/nbdev_export
	$(OFFLINE) $(BIN)/python -m pytest tests/ -q -p no:cacheprovider -m "not slow"

export:  ## notebooks -> nanorl/, then clean the notebooks
	$(BIN)/nbdev_export && $(BIN)/nbdev_clean

readme: $(STAMP)  ## README.md from nbs/index.ipynb
	$(BIN)/jupyter nbconvert --log-level WARN --to markdown nbs/index.ipynb --output-dir . --output README
	sed -i 's#](images/#](nbs/images/#g' README.md  # image links relative to the repository root

lab: $(STAMP)  ## open the course in JupyterLab
	$(BIN)/jupyter lab nbs/
