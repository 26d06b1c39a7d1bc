# The two commands a new user needs:  make train  and  make test.  Both set up the machine first.
BUILD ?= build
NPROC ?= 2
CONFIG ?= configs/llama3_debug.toml
JOBS ?= $(shell nproc)
LOOM := $(BUILD)/bin/loom
# `make train` keeps its final weights for `loom generate`: one model-only save after the last step
# (the interval lies past training.steps), no resumable checkpoints.
TRAIN_ARGS ?= --checkpoint.enable=true --checkpoint.model_only=true --checkpoint.interval=1000000

.PHONY: all setup configure build build-loom train test bench docs clean

all: build

setup:
	@scripts/setup.sh

# clang compiles Loom's libtorch-heavy sources about twice as fast as g++ (its precompiled header
# loads lazily and holds the header templates' instantiations: docs/building.md); g++ where clang is
# absent. The choice is made when the build folder is first configured.
CXX_COMPILER ?= $(shell command -v clang++-14 || command -v clang++ || command -v c++)

$(BUILD)/build.ninja: CMakeLists.txt | setup
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=$(CXX_COMPILER)

configure: setup $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# Only the `loom` binary and the libraries it links: what training needs (no tests, workers, benches).
build-loom: configure
	cmake --build $(BUILD) -j $(JOBS) --target loom

# Trains the default debug model on the default corpus on $(NPROC) local ranks (FSDP/DDP per config)
# and keeps its final weights (a model-only save) for `loom generate`.
train: build-loom data/default/tokenizer.json
	$(LOOM) launch --nproc $(NPROC) -- train --config $(CONFIG) $(TRAIN_ARGS)

# Retrained whenever set-up remakes the corpus.
data/default/tokenizer.json: data/default/corpus.txt | build-loom
	$(LOOM) tokenizer train --input data/default/corpus.txt --vocab-size 2048 --output $@

# Every unit, multi-rank and parity test (ctest runs the gtest binaries and the Python parity
# checks, two at a time where they are single-threaded), then the suite's time budget check.
test: build data/default/tokenizer.json
	scripts/run_tests.sh $(BUILD)

# docs/config.md's tables come from the config schema (the sections train/config.cpp lists): rewrite them.
docs: build
	sed '/^<!-- generated below/q' docs/config.md > docs/config.md.new
	$(LOOM) train --config-reference >> docs/config.md.new
	echo '<!-- [rl] generated below by `loom rl --config-reference` (make docs) -->' >> docs/config.md.new
	$(LOOM) rl --config-reference >> docs/config.md.new
	mv docs/config.md.new docs/config.md

bench: build
	bench/run_all.sh $(BUILD)

clean:
	rm -rf $(BUILD)
