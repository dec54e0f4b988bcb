"""Plain builders the tests share (fixtures stay in conftest.py): configs, the tiny model's LLM and engine, greedy
sampling parameters, `kvreuse serve` arguments, a bounded loop that runs an engine until it is done, and the real
app served in-process.

Config overrides are keyword arguments spelled ``section__key=value`` (``cache__suffix__enabled="true"`` is
``--set cache.suffix.enabled=true``), given as text or numbers, exactly what ``load_config(None, [...])`` parses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kvreuse.config import Config, load_config
from kvreuse.engine.engine import LLMEngine
from kvreuse.layers.logits_processors import SamplingRow
from kvreuse.layers.sampler import sample_rows
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

# What a tiny-model engine gets unless a test sets it: fp32 (the tests that compare outputs are written for it) and a
# fixed pool, not one derived from kv_cache_memory_mb.
TINY_SETS = {"model__dtype": "fp32", "engine__num_kv_blocks": 256}


def make_config(**sets: object) -> Config:
    """The defaults with ``section__key=value`` overrides (see the module docstring)."""
    return load_config(None, [f"{key.replace('__', '.')}={value}" for key, value in sets.items()])


def tiny_config(model_dir: str, **sets: object) -> Config:
    """The tiny model at `model_dir` (conftest's `tiny_model_dir`), TINY_SETS, then `sets`."""
    return make_config(**{"model__path": model_dir, **TINY_SETS, **sets})


def tiny_llm(model_dir: str, **sets: object) -> LLM:
    """An LLM on the tiny model: `tiny_config(model_dir, **sets)`."""
    return LLM(tiny_config(model_dir, **sets))


def tiny_engine(model_dir: str, **sets: object) -> LLMEngine:
    """An LLMEngine on the tiny model: `tiny_config(model_dir, **sets)` (what `tiny_llm(...).engine` is)."""
    return LLMEngine(tiny_config(model_dir, **sets))


def greedy(max_tokens: int, **overrides: object) -> SamplingParams:
    """Greedy decoding (temperature 0, the default) of exactly `max_tokens` tokens: EOS does not end it."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **overrides)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """The sampler on logits [S, vocab] fp32 with one params and generator per row (`sample_rows` without the rest of
    a sampling row): its token ids."""
    if len(params) != len(generators) or len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows, {len(params)} params, {len(generators)} generators")
    return sample_rows(logits, [SamplingRow(p, g) for p, g in zip(params, generators, strict=True)])[0]


def server_args(model_dir: str, *sets: str) -> list[str]:
    """`kvreuse serve` arguments for the tiny model in fp32, with a ``--set`` for each ``section.key=value``."""
    args = ["--model", model_dir, "--dtype", "fp32"]
    for item in sets:
        args += ["--set", item]
    return args


def drain(engine: LLMEngine, max_steps: int = 10_000, check_integrity: bool = False) -> int:
    """Step `engine` until it has nothing unfinished; the number of steps it took. An AssertionError if it is not
    done after `max_steps` (a step with nothing to run waits 50 ms for a load, so the default bounds a test that
    would hang, not a slow one); with `check_integrity`, the engine's integrity check after every step."""
    steps = 0
    while engine.has_unfinished():
        if steps >= max_steps:
            raise AssertionError(f"still unfinished after {max_steps} steps")
        engine.step()
        steps += 1
        if check_integrity:
            engine.check_integrity()
    return steps


@contextmanager
def app_server(engine: LLMEngine, api_keys: dict[str, str] | None = None,
               timeout: float = 30.0) -> Iterator[tuple[object, str]]:
    """The real FastAPI app serving `engine` as model "tiny" (with `api_keys`: key -> tenant) under uvicorn on a
    thread, on 127.0.0.1 at a free port; yields the app and its root URL. Every wait is bounded by `timeout`."""
    import uvicorn

    from kvreuse.server.app import create_app

    app = create_app(engine, "tiny", api_keys)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        assert not thread.is_alive(), "the in-process server did not stop"


def doc_block(doc: Path, language: str, containing: str) -> str:
    """The fenced ```language block (plain ``` for language "") of the markdown file `doc` that contains
    `containing`: what a reader copies, run by the tests as written."""
    blocks, fence, lines = [], None, []
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            if fence is None:
                fence, lines = line[3:].strip(), []
            else:
                blocks.append((fence, "\n".join(lines) + "\n"))
                fence = None
        elif fence is not None:
            lines.append(line)
    return next(text for fence, text in blocks if fence == language and containing in text)
