# The two commands a new user needs:  make train  and  make test.  Both set up the machine first.
BUILD ?= build
NPROC ?= 2
CONFIG ?= configs/llama3_debug.toml
JOBS ?= $(shell nproc)
LOOM := $(BUILD)/bin/loom

.PHONY: all setup configure build train test bench docs clean

all: build

setup:
	@scripts/setup.sh

$(BUILD)/build.ninja: CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release

configure: setup $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# Trains the default debug model on the default corpus on $(NPROC) local ranks (FSDP/DDP per config).
train: build data/default/tokenizer.json
	$(LOOM) launch --nproc $(NPROC) -- train --config $(CONFIG)

# Retrained whenever set-up remakes the corpus.
data/default/tokenizer.json: data/default/corpus.txt | build
	$(LOOM) tokenizer train --input data/default/corpus.txt --vocab-size 2048 --output $@

# Every unit, multi-rank and parity test (ctest runs the gtest binaries and the Python parity checks).
test: build data/default/tokenizer.json
	ctest --test-dir $(BUILD) --output-on-failure --timeout 900 -j 1

# docs/config.md's tables come from the config schema (src/loom/train/config.cpp): rewrite them.
docs: build
	sed '/^<!-- generated below/q' docs/config.md > docs/config.md.new
	$(LOOM) train --config-reference >> docs/config.md.new
	mv docs/config.md.new docs/config.md

bench: build
	bench/run_all.sh $(BUILD)

clean:
	rm -rf $(BUILD)
