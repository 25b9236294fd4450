# make demo   the main job (builds first)
# make test   the whole test suite (builds first)
# make bench  the benchmarks; rewrites docs/performance.md (builds first)
# All three set up everything themselves (scripts/in_env.sh): an installed LibTorch >= 2.6,
# else a project venv with PyTorch from PyPI (.venv, scripts/setup_venv.sh), else, where PyPI
# is out of reach, a Debian 13 build root (scripts/buildroot.sh). docs/building.md: "Choosing the LibTorch".
BUILD ?= build
RUN := scripts/in_env.sh
JOBS ?= $(shell nproc)

.PHONY: all configure build demo test bench format clean

all: build

configure:
	$(RUN) cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)

build: configure
	$(RUN) cmake --build $(BUILD) -j $(JOBS)

# The demo's corpus: this repository's own docs and sources (validation: each file's end).
DEMO_DATA := --data README.md --data docs --data src --data include --data models \
             --data examples --data trainer --data tests

# Builds only what it runs: the library, hp-run and the trainer.
demo: configure
	$(RUN) cmake --build $(BUILD) -j $(JOBS) --target hp-run train_decoder
	$(RUN) $(BUILD)/hp-run -n 4 --timeout 600 -- $(BUILD)/trainer/train_decoder $(DEMO_DATA) \
	    --out $(BUILD)/demo --require-learning $(DEMO_ARGS)

test: build
	$(RUN) ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) $(CTEST_ARGS)

# Benchmarks (about 20 minutes on 2 cores); rewrites docs/performance.md. Some of them:
# make bench BENCH_ARGS="--only memory,beyond" (sections: see bench/run.sh).
bench: build
	$(RUN) bench/run.sh $(BUILD) $(BENCH_ARGS)

format:
	$(RUN) clang-format -i $(shell git ls-files '*.cpp' '*.h')
	$(RUN) ruff format $(shell git ls-files '*.py')

clean:
	rm -rf $(BUILD)
