# Two entry points for a fresh machine: `make run` (install + default job), `make test` (install + tests).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test test-long test-stress test-unit bench clean

# torch/torchvision first (SGLang's pinned CUDA build, which also runs on CPU), then the complete
# pinned set without resolution: sglang's metadata asks for CUDA-only kernels that CPU mode never imports.
$(STAMP): pyproject.toml scripts/requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install --quiet --no-deps -r scripts/requirements.lock
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m pipeline.intake.model
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/harvest run conf/default.yaml

test: install
	$(BIN)/python -m pytest tests -q -p no:cacheprovider -m "not stress and not long" --durations=40

test-stress: install
	$(BIN)/python -m pytest tests -q -p no:cacheprovider -m stress -s

test-long: install
	$(BIN)/python -m pytest tests -q -p no:cacheprovider -m long --durations=20

test-unit: install
	$(BIN)/python -m pytest tests/unit -q

bench: install
	$(BIN)/python bench/bench_throughput.py

clean:
	rm -rf out
