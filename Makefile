# Every target creates .venv itself, so a fresh clone needs only `make train` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv train test test-fast mutants lint docs format clean gpu-wheels

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU machines: take the local CPU build of torch first so the range below installs nothing more.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(BIN)/effpretrain train $(ARGS)

# Two pytest workers with one thread each use both cores without oversubscription (OpenMP threads
# of concurrent processes spin against each other and slow tiny-model tests down many times over).
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

# The edit-test loop: unit tests and the in-process runs of one method per family (markers in
# tests/conftest.py), every module touched; the whole suite stays `make test`.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m fast $(PYTEST_ARGS)

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
