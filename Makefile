# Wraps CMake: `make` builds everything, `make test` runs every test (release build, then
# AddressSanitizer+UBSan build, then ThreadSanitizer on the transport), `make run` the main job.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# The makes that cmake --build runs under this one would each print "Entering directory"
# lines around the build's output.
MAKEFLAGS += --no-print-directory

.PHONY: all deps build test test-release test-asan test-tsan run bench clean format

all: build

deps:
	@bash scripts/deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

test: test-release test-asan test-tsan

test-release: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# OpenBLAS under ASan: oneDNN allocates its GEMM's packing buffers with malloc on every
# call, which ASan's allocator holds on to (quarantine, redzones), so resident peaks run
# 15-21% above what the planner predicts and test-plan fails. TSan keeps AUTO (oneDNN):
# the tsan tests run clean with it (docs/core.md, "GEMM providers"). TSan builds without
# -march=native, so the portable build (RTP_NATIVE=OFF) is compiled on every run too.
test-asan: deps
	cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DRTP_SANITIZE='address;undefined' \
	  -DRTP_BUILD_BENCH=OFF -DRTP_CUDA=OFF -DRTP_GEMM=BLAS $(CMAKE_FLAGS) >/dev/null
	cmake --build $(BUILD)-asan -j $(JOBS)
	cd $(BUILD)-asan && ctest --output-on-failure -j $(JOBS) -LE slow

test-tsan: deps
	cmake -S . -B $(BUILD)-tsan -DCMAKE_BUILD_TYPE=Debug -DRTP_SANITIZE=thread \
	  -DRTP_BUILD_BENCH=OFF -DRTP_BUILD_EXAMPLES=ON -DRTP_CUDA=OFF -DRTP_NATIVE=OFF \
	  $(CMAKE_FLAGS) >/dev/null
	cmake --build $(BUILD)-tsan -j $(JOBS)
	cd $(BUILD)-tsan && ctest --output-on-failure -j $(JOBS) -L tsan

run: build
	./$(BUILD)/tools/rtp-run -n 2 -- ./$(BUILD)/examples/train-gpt --config tiny --strategy rtp \
	  --steps 4000 --batch 8 --sample 64

bench: build
	./$(BUILD)/bench/bench-core
	./$(BUILD)/bench/bench-parallel

format:
	clang-format -i $$(git ls-files '*.c' '*.h' '*.cpp' '*.hpp' '*.cu')

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-tsan
