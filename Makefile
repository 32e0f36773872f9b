# The README's two commands: `make demo` and `make test`. Both install what is missing first.
BUILD_DIR ?= build
FUZZ_BUILD_DIR ?= build-fuzz
JOBS ?= $(shell nproc)
DEMO_MODEL ?= models/demo-tiny
FUZZ_SECONDS ?= 20
# ccache hits across clones in different folders (CI builds a fresh clone).
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1

.PHONY: all deps configure build test test-noucx demo fuzz bench bench-serve clean

all: build

deps:
	bash scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build fuzz
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

# The demo runs the preft CLI only (`preft serve` embeds the router and both workers): it builds
# that target and what it links, not every test, benchmark and fuzzer (`make test` does).
DEMO_TARGETS ?= preft
demo: configure
	@echo "== building $(DEMO_TARGETS) in $(BUILD_DIR) ($(JOBS) jobs; [done/total] objects below)"
	cmake --build $(BUILD_DIR) -j $(JOBS) --target $(DEMO_TARGETS)
	bash scripts/demo.sh $(BUILD_DIR) $(DEMO_MODEL)

# The build without UCX (-DPREFT_ENABLE_UCX=OFF: KV over gRPC only), as a machine without
# libucx-dev gets it: the binaries build and a five-process cluster serves with --transport grpc.
NOUCX_BUILD_DIR ?= build-noucx
test-noucx: deps
	cmake -S . -B $(NOUCX_BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release -DPREFT_ENABLE_UCX=OFF
	cmake --build $(NOUCX_BUILD_DIR) -j $(JOBS) --target preft preft-router preft-prefill preft-decode
	PREFT_TRANSPORT=grpc bash tests/tools/local_cluster_test.sh . $(NOUCX_BUILD_DIR) \
	  $(NOUCX_BUILD_DIR)/local_cluster

# libFuzzer targets need clang; each runs briefly on its seed corpus.
fuzz: deps
	bash scripts/fuzz.sh $(FUZZ_BUILD_DIR) $(FUZZ_SECONDS)

bench: build
	bash scripts/bench.sh $(BUILD_DIR)

# The headline table (docs/RESULTS.md): PreFT vs multi-LoRA vs base, disaggregated and
# colocated, on the qwen2.5-0.5b preset; BENCH_SERVE_FLAGS overrides the workload.
BENCH_SERVE_OUT ?= bench/results/qwen2.5-0.5b
bench-serve: build
	/usr/bin/python3 bench/serve/matrix.py --build $(BUILD_DIR) --model models/qwen2.5-0.5b-bf16 \
	  --preset qwen2.5-0.5b --out $(BENCH_SERVE_OUT) $(BENCH_SERVE_FLAGS)

clean:
	rm -rf $(BUILD_DIR) $(FUZZ_BUILD_DIR) $(NOUCX_BUILD_DIR)
