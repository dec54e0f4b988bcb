"""Shared fixtures: the real embedded model (loaded once) and a tiny random-weight Llama in HF format; and the
`slow` marker, kept honest.

`slow` marks every test that loads the real embedded model, so `pytest -m "not slow"` is a fast development
subset (`make test` runs everything). Tests using a fixture in REAL_MODEL_FIXTURES are marked here; any other
test that loads the embedded model's weights without the marker fails, naming itself (see
`_embedded_model_guard`). Loading only the tokenizer (`real_tokenizer`) is fast and needs no marker.

Plain builders (configs, tiny-model LLMs and engines, greedy parameters, server arguments, `drain`) are in
helpers.py.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import save_file

from kvreuse.llm import LLM
from kvreuse.model import decode_graph
from kvreuse.tuning import dtype_probe
from kvreuse.weights import loader
from kvreuse.weights.loader import embedded_model_path, file_sha256
from kvreuse.weights.tokenizer import Tokenizer

# make_config is also imported from here, by test_analyze, test_cache_cli and test_soak
from .helpers import make_config, tiny_config

# Fixtures that load the real embedded model, in this process or in a `kvreuse serve` subprocess (which the guard
# below cannot see): every test using one, directly or through another fixture, is marked slow.
REAL_MODEL_FIXTURES = frozenset({
    "real_llm",             # conftest.py
    "real_segment_llm",     # test_segment_reuse.py
    "real_server",          # test_server.py, test_openai_fields.py (subprocess)
    "hf_model",             # test_structured.py (the GGUF through transformers)
})

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# --- the guard: loading the embedded model's weights outside a slow test fails that test -------------------------
_running: list[pytest.Item] = []          # the test being set up, run or torn down
_violations: dict[str, str] = {}          # nodeid -> what it loaded (checked again after the test, see below)
_lock = threading.Lock()
_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.remove(item)


def _check_may_load(what: str) -> None:
    item = _running[-1] if _running else None
    if item is None or item.get_closest_marker("slow") is not None:
        return
    message = (f"{item.nodeid} loads the real embedded model ({what}) but is not marked slow: mark it "
               f"@pytest.mark.slow, or use the tiny model (tiny_model_dir / tiny_llm), so that "
               f"`pytest -m \"not slow\"` stays fast")
    with _lock:
        _violations.setdefault(item.nodeid, message)
    pytest.fail(message, pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _embedded_model_guard():
    """Installed before any other session fixture (autouse, session scope), so that a session fixture loading the
    model during an unmarked test's setup is caught too. It wraps our GGUF loader (the embedded model is the only
    GGUF it is given in tests) and gguf's dequantize (transformers' `from_pretrained(gguf_file=...)` weights; its
    tokenizer loading reads only the vocabulary and never dequantizes)."""
    import gguf

    original_load_gguf, original_dequantize = loader._load_gguf, gguf.dequantize
    embedded = embedded_model_path()

    def load_gguf(path, *args, **kwargs):
        if path.resolve() == embedded.resolve():
            _check_may_load(f"kvreuse.weights.loader.load_weights({path.name})")
        return original_load_gguf(path, *args, **kwargs)

    def dequantize(*args, **kwargs):
        _check_may_load("GGUF weights dequantized, e.g. transformers from_pretrained(gguf_file=...)")
        return original_dequantize(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "_load_gguf", load_gguf)
        mp.setattr(gguf, "dequantize", dequantize)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test whose load was caught but whose failure was swallowed (a broad `except`, another thread) fails too."""
    report = yield
    if report.when in ("call", "teardown"):
        with _lock:
            message = _violations.pop(item.nodeid, None)
        if message is not None and report.passed and not item.stash.get(_FAILED, False):
            report.outcome, report.longrepr = "failed", message
    elif report.failed:
        item.stash[_FAILED] = True
    return report


@pytest.fixture(autouse=True)
def _auto_dtype_is_fp32(monkeypatch):
    """`model.dtype = auto` resolves to fp32 in every test, as it did before the dtype probe: the tests that compare
    outputs (with HF, with each other) are written for fp32, the probe's answer depends on the machine (the tiny
    model's shapes sit near the tie on an AMX CPU), and tests time nothing. test_dtype_probe.py overrides this."""
    fp32_faster = dtype_probe.Figures(dtype_probe.PREFILL_TOKENS, 1.0, 2.0, 1.0, 2.0, probe_s=0.0)
    result = dtype_probe.ProbeResult(fp32_faster, flops_per_token=1.0, cache_path=None, from_cache=False)
    monkeypatch.setattr(dtype_probe, "probe", lambda args: result)


_START_DECODE_COMPILE = decode_graph.DecodeGraph.start


@pytest.fixture(scope="session", autouse=True)
def _no_background_compile():
    """Engines built in the tests decode eagerly (`engine.compile = decode` is the default): a background compile
    costs ~30 s of a CPU the tests share, and tests time nothing. Session-wide, so that session fixtures' engines
    (real_llm, tiny_llm) are covered too; the `compiling` fixture restores it for one test."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_graph.DecodeGraph, "start", lambda self, build=True: None)
        yield


@pytest.fixture
def compiling(monkeypatch):
    """Engines built in this test compile their decode step, as they do outside the tests."""
    monkeypatch.setattr(decode_graph.DecodeGraph, "start", _START_DECODE_COMPILE)


@pytest.fixture(scope="session")
def real_tokenizer() -> Tokenizer:
    path = embedded_model_path()
    return Tokenizer.load(path, file_sha256([path]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_tokenizer) -> str:
    """A 2-layer Llama with random weights and the real SmolLM2 tokenizer, saved as an HF directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = len(real_tokenizer.hf)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, **TINY}
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    h, i, d = TINY["hidden_size"], TINY["intermediate_size"], TINY["head_dim"]
    q, kv = TINY["num_attention_heads"] * d, TINY["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for layer in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    tensors = {name: (1.0 + 0.1 * torch.randn(shape, generator=g)) if len(shape) == 1
               else torch.randn(shape, generator=g) * shape[1] ** -0.5 for name, shape in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"))
    real_tokenizer.hf.save_pretrained(str(path))
    return str(path)


@pytest.fixture
def tiny_llm(tiny_model_dir) -> LLM:
    """A fresh LLM on the tiny model with helpers.TINY_SETS (fp32, 256 blocks); helpers.tiny_llm builds variants."""
    return LLM(tiny_config(tiny_model_dir))


@pytest.fixture(scope="session")
def real_llm() -> LLM:
    """The embedded SmolLM2-135M in fp32, shared by the tests that only read from it."""
    return LLM(make_config(model__dtype="fp32", engine__num_kv_blocks=512))


# --- a real redis-server for the Redis tier's tests ---------------------------------------------------------------
@pytest.fixture(scope="session")
def redis_server():
    """One redis-server for the whole session (ours alone, so tests may flush it); stopped at the end."""
    import shutil

    from kvreuse.bench.redis_process import INSTALL_HINT, RedisProcess

    if shutil.which("redis-server") is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    with RedisProcess() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    """The shared server's URL, its data flushed before the test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


# --- a tiny Gemma 3 on a grouped pool (kvcache/layout.py) ----------------------------------------------------------
GROUPED_GEMMA_WINDOW = 20  # no multiple of the block sizes the tests use
GROUPED_GEMMA_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # 2 full, 4 sliding: 3 groups


@pytest.fixture(scope="session")
def grouped_gemma_dir(tmp_path_factory, real_tokenizer) -> str:
    """A random-weight Gemma 3 whose pool has 3 layer groups of 2 (window 20), with the real tokenizer."""
    from .test_architectures import build

    return str(build("gemma3", tmp_path_factory.mktemp("gemma3-grouped"), len(real_tokenizer.hf), real_tokenizer,
                     num_hidden_layers=len(GROUPED_GEMMA_LAYERS), layer_types=GROUPED_GEMMA_LAYERS,
                     sliding_window=GROUPED_GEMMA_WINDOW))


@pytest.fixture
def zmq_context():
    """A ZMQ context of the test's own, destroyed (linger 0) at its end."""
    import zmq

    context = zmq.Context()
    yield context
    context.destroy(linger=0)
