# The README's two commands: `make demo` and `make test`. Both install what is missing first.
BUILD_DIR ?= build
FUZZ_BUILD_DIR ?= build-fuzz
JOBS ?= $(shell nproc)
DEMO_MODEL ?= models/demo-tiny
FUZZ_SECONDS ?= 20
# ccache hits across clones in different folders (CI builds a fresh clone).
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1

.PHONY: all deps configure build test demo fuzz bench clean

all: build

deps:
	bash scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build fuzz
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

demo: build
	bash scripts/demo.sh $(BUILD_DIR) $(DEMO_MODEL)

# libFuzzer targets need clang; each runs briefly on its seed corpus.
fuzz: deps
	bash scripts/fuzz.sh $(FUZZ_BUILD_DIR) $(FUZZ_SECONDS)

bench: build
	bash scripts/bench.sh $(BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR) $(FUZZ_BUILD_DIR)
