# scaletrain — the two commands of the README:
#   make run    installs what is missing, builds, runs the main job
#   make test   installs what is missing, builds, runs every test
SHELL := /bin/bash
BUILD ?= build
# The machine's cores: GNU nproc reports OMP_NUM_THREADS instead where it is set.
CORES := $(shell env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
JOBS ?= $(CORES)
ifeq ($(shell echo '$(JOBS)' | grep -Ex '[1-9][0-9]*'),)
$(error JOBS=$(JOBS) is not a positive number of parallel jobs; e.g. make test JOBS=2)
endif
CMAKE_FLAGS ?=
CTEST_FLAGS ?=

.PHONY: all setup configure build run test test-isa asan-test bench gpu-check format tidy clean

all: build

setup:
	@scripts/setup.sh

configure: setup
	@[ -f $(BUILD)/build.ninja ] || cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS)

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# The main job: LeNet on Fashion-MNIST with DDP over the local devices (every GPU, else a CPU
# process per core, at most 8), with progress, checkpoints and metrics under runs/lenet.
run: build
	$(BUILD)/scaletrain train --out runs/lenet

# Every test, the numeric ones also under each CPU dispatch level below this machine's own (the
# `isa-<level>/` entries: tests/numeric_tests.txt, Note [Tolerances] in tests/support/tolerance.h).
# JOBS entries run at once, and each one's processes get cores / JOBS threads (at least 1),
# unless OMP_NUM_THREADS is set: with a full-size pool each, 8 entries at a time ran ~10x slower
# on a 16-core machine and some timed out (docs/build.md, "Threads per test"). TEST_JOBS=3 on
# two cores is faster (649 s against 792 s) but not the default: see "One entry more than the
# cores" there.
TEST_THREADS ?= $(shell n=$$(( $(CORES) / $(JOBS) )); echo $$(( n > 0 ? n : 1 )))
TEST_JOBS ?= $(JOBS)

test: build
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$(TEST_THREADS)} \
	  ctest --test-dir $(BUILD) --output-on-failure -j $(TEST_JOBS) --timeout 600 $(CTEST_FLAGS)

# The numeric tests under every CPU dispatch level this machine offers (default, avx2, avx512).
test-isa: build
	scripts/test-isa.sh $(BUILD)

# Every test under AddressSanitizer + UndefinedBehaviorSanitizer, in its own build folder.
asan-test:
	$(MAKE) test BUILD=build-asan CMAKE_FLAGS="-DSCALETRAIN_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug"

# Every experiment of the seeds: raw CSV, JSON statistics, PNG plots, bench-out/report.md.
bench: build
	$(BUILD)/scaletrain bench all --out bench-out

# On a machine with a GPU and a Python PyTorch: build against it with CUDA, run every test.
gpu-check:
	scripts/gpu-check.sh

format:
	clang-format -i $$(git ls-files '*.cpp' '*.h')

# clang-tidy needs a compile command per file: its own build folder, without unity batches.
tidy: setup
	@[ -f build-tidy/build.ninja ] || cmake -S . -B build-tidy -G Ninja -DSCALETRAIN_UNITY_BUILD=OFF
	clang-tidy -p build-tidy $$(git ls-files 'src/*.cpp')

clean:
	rm -rf $(BUILD) build-asan build-tidy
