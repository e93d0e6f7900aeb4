# Every target creates .venv itself, so a fresh clone needs only `make train` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# A CUDA build of torch for a machine with an NVIDIA driver: PyPI's Linux wheel is one (the exact
# version string, ===, passes over a CPU build such as 2.13.0+cpu that a local wheel folder may
# offer). Another CUDA: make venv TORCH_CUDA='torch==2.13.0+cu126 --index-url https://download.pytorch.org/whl/cu126'
TORCH_CUDA ?= torch===$(TORCH_VERSION)

.PHONY: venv train test test-fast test-gpu mutants lint docs format clean gpu-wheels

# The 'lowbit-ref' extra (torchao, a numerics reference) goes to a folder off the import path,
# which only the test that compares with it puts on its path (transformers imports an installed
# torchao at start-up; its warnings would reach the stderr that the CLI's error tests read).
# torch first, so the range in pyproject.toml installs nothing more: where an NVIDIA driver is
# loaded (effpretrain/devices.py looks for its files; nvidia-smi need not be on PATH) a CUDA build,
# checked to be one; elsewhere the CPU build. -I: the script's folder stays off the import path.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if $(BIN)/python -I effpretrain/devices.py; then \
		$(BIN)/pip install -q $(TORCH_CUDA) && \
		$(BIN)/python -c 'import sys, torch; sys.exit(torch.version.cuda is None)' || \
		{ echo "an NVIDIA driver is loaded but no CUDA build of torch installed; set TORCH_CUDA (see Makefile)" >&2; exit 1; }; \
	else \
		$(BIN)/pip install -q torch==$(TORCH_VERSION); \
	fi
	$(BIN)/pip install -q -e '.[dev]'
	rm -rf $(VENV)/lowbit-ref && $(BIN)/pip install -q --no-deps --target $(VENV)/lowbit-ref \
		"$$(grep -o 'torchao==[0-9.]*' pyproject.toml)"
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(BIN)/effpretrain train $(ARGS)

# Two pytest workers with one thread each use both cores without oversubscription (OpenMP threads
# of concurrent processes spin against each other and slow tiny-model tests down many times over).
# tests/conftest.py hides every GPU from the suite and its children (the same results on any
# machine); the CUDA-only tests are make test-gpu's.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m 'not slow and not gpu' $(PYTEST_ARGS)

# The edit-test loop: unit tests and the in-process runs of one method per family (markers in
# tests/conftest.py), every module touched; the whole suite stays `make test`.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m fast $(PYTEST_ARGS)

# The CUDA-only tests (tests/gpu/, marker gpu), one process, with the GPUs visible; not part of
# make test or CI. Without a visible GPU each one is skipped.
test-gpu: $(STAMP)
	EFFPRETRAIN_TEST_GPU=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

# Mutation checks (tests/mutants.py): each named breakage of the product, applied to a copy of the
# checkout, must make the tests that claim the behaviour fail; lists which tests caught each one.
mutants: $(STAMP)
	$(BIN)/python tests/mutants.py $(MUTANTS_ARGS)

# The generated reference pages, then the site; strict: a broken link or a page missing from the
# navigation fails the build.
docs: $(STAMP)
	$(BIN)/python -m effpretrain.reference
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: $(STAMP)
	$(BIN)/ruff check effpretrain optimizers tests benchmarks examples
	$(BIN)/ruff format --check effpretrain optimizers tests benchmarks examples

format: $(STAMP)
	$(BIN)/ruff format effpretrain optimizers tests benchmarks examples
	$(BIN)/ruff check --fix effpretrain optimizers tests benchmarks examples

# Wheels for a GPU machine without network (benchmarks/gpu_check.py's 8-bit and HF sections), for
# its Python 3.12: carried in the ignored folder .whl/ and installed there with --no-index.
gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl bitsandbytes galore-torch

clean:
	rm -rf $(VENV) runs site .pytest_cache
