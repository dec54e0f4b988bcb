"""`kvreuse serve`: load, warm up, announce readiness on stdout, serve, and drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
import signal
import sys
from pathlib import Path

import uvicorn

from kvreuse.config import CacheConfig, Config
from kvreuse.config.named_models import NAMED_MODELS
from kvreuse.engine.front_end import FrontEnd
from kvreuse.engine.stats import compile_summary
from kvreuse.server.async_engine import load_engine
from kvreuse.server.auth import load_api_keys

logger = logging.getLogger(__name__)

# After the drain deadline, the time the cut requests have to send their last bytes before uvicorn cancels
# whatever still runs (a request still uploading its body, say).
CUT_GRACE_S = 5
APP_MODULE = "kvreuse.server.app"


def serve(config: Config, *, log_level: str = "warning") -> int:
    """Serve `config`'s model over HTTP as `served_model_name(...)` until SIGTERM or SIGINT; returns the exit code
    (0 once drained). Raises ConfigError for a bad API key file, ModelLoadError for bad weights."""
    api_keys = load_api_keys(config.server.api_keys_file) if config.server.api_keys_file else None
    engine = load_engine(config, meanwhile=prefetch_app)
    if APP_MODULE not in sys.modules:  # the prefetch failed: import again, on one thread, from fresh directory listings
        importlib.invalidate_caches()
    from kvreuse.server.app import create_app

    model_name = served_model_name(config, engine.front_end.model_path)
    app = create_app(engine, model_name, api_keys)
    return run_http(app, config, describe(config, engine.front_end, model_name, api_keys), log_level)


def prefetch_app() -> None:
    """Import the HTTP app's modules (fastapi, the pydantic models: ~0.14 s) while the model loads on another thread.
    Python 3.11's imports on two threads at once can fail for a module that exists (a ModuleNotFoundError for
    kvreuse.server.usage, seen once in CI); such a failure is only logged, and left to the import after the load,
    which raises if the error is real."""
    try:
        importlib.import_module(APP_MODULE)
    except ImportError as exc:
        logger.warning("importing the HTTP app while the model loaded failed (%s: %s); importing it again after",
                       type(exc).__name__, exc)


def describe(config: Config, front: FrontEnd, model_name: str, api_keys: dict | None, cluster: str = "") -> str:
    """What the ready line says after the URL (`cluster`: what a cluster adds, after the per-replica pool)."""
    quantized = f" quantization={config.model.quantization}" if config.model.quantization != "none" else ""
    return (f"model={model_name} dtype={front.dtype_description}{quantized} max_model_len={front.max_model_len} "
            f"kv_capacity={front.describe_kv()}"
            f"{' ' + cluster if cluster else ''} prefix_caching={'on' if config.cache.enabled else 'off'} "
            f"auth={'api-keys' if api_keys else 'off'}")


# What the settings line says of the decode step in each state (stats.compile_summary).
COMPILE_NOTES = {"eager": "eager", "compiling": "compiling, eager until done (/health says when)",
                 "compiled": "compiled", "failed": "eager, its compile failed (see the warning above)",
                 "cancelled": "eager, its compile was cancelled",
                 "unknown": "compiled by each replica, eager until then (/health says how far once they serve)"}


def settings_line(config: Config, compile_state: str) -> str:
    """The line after the ready line: every approximate or non-default behaviour that is on, each with the key that
    turns it off, then the decode step's state; "defaults: exact prefix reuse only, LRU eviction" when none is."""
    cache, on = config.cache, []
    if not cache.enabled:
        on.append("no KV reuse (cache.enabled)")
    if cache.preset != "none":
        on.append(f"preset {cache.preset} (cache.preset)")
    if cache.suffix.enabled:
        s = cache.suffix
        repair = f"blend recomputing {s.recompute_ratio:.0%}" if s.mode == "blend" else "shift, unrepaired"
        guard = f"guard {s.guard_margin:g} nats" if s.guard_margin else "no guard"
        on.append(f"segment reuse, approximate: {repair}, {guard} (cache.suffix.enabled)")
    if cache.normalize_input:
        on.append("input normalized, changes what the model reads (cache.normalize_input)")
    if config.model.quantization != "none":
        on.append(f"weights quantized to {config.model.quantization}, approximate (model.quantization)")
    if cache.kv_dtype in ("int8", "fp8"):
        on.append(f"KV in {cache.kv_dtype}, approximate (cache.kv_dtype)")
    elif cache.kv_dtype != "auto":
        on.append(f"KV in {cache.kv_dtype} (cache.kv_dtype)")
    if cache.policy != "lru":
        on.append(f"eviction {cache.policy} (cache.policy)")
    if cache.disk.path:
        on.append(f"disk tier {cache.disk.path} (cache.disk.path)")
    if cache.redis.url:
        on.append("Redis tier (cache.redis.url)")  # not the URL: it may hold a password
    default = CacheConfig()
    if (cache.session_retention_s, cache.session_max_share) != (default.session_retention_s,
                                                                default.session_max_share):
        on.append(f"session retention {cache.session_retention_s:g} s, up to {cache.session_max_share:.0%} of the "
                  f"pool (cache.session_retention_s, cache.session_max_share)")
    if config.engine.threads:
        on.append(f"{config.engine.threads} threads, fixed (engine.threads)")
    behaviour = "; ".join(on) or "defaults: exact prefix reuse only, LRU eviction"
    decode = "eager (engine.compile off)" if config.engine.compile == "off" else COMPILE_NOTES.get(compile_state,
                                                                                                  compile_state)
    return f"{behaviour}; decode step {decode}"


def run_http(app, config: Config, description: str, log_level: str = "warning") -> int:
    """Serve `app` on `server.host`:`server.port`, print the ready line with `description` once it accepts
    connections, and drain on SIGTERM/SIGINT (see DrainingServer); returns the exit code (0 once drained)."""
    drain_s = config.server.drain_timeout_s
    # uvicorn's own timeout is only the backstop: at drain_s the app cuts what still runs, cleanly.
    server = DrainingServer(uvicorn.Config(app, host=config.server.host, port=config.server.port,
                                           log_level=log_level.lower(),
                                           timeout_graceful_shutdown=drain_s + CUT_GRACE_S),
                            description, drain_s)
    # uvicorn re-raises the signal that stopped it once it has drained; a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0


def served_model_name(config: Config, weights: Path) -> str:
    """The model id clients send: `model.served_name`; else the name `model.path` gave for a named model
    (`gemma3-270m`), which clients know, not the file it stands for; else the weights' name (`model_name_of`)."""
    if config.model.served_name:
        return config.model.served_name
    if config.model.path in NAMED_MODELS:
        return config.model.path
    return model_name_of(weights)


def model_name_of(weights: Path) -> str:
    """The id a weights file is served as: SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct."""
    return re.sub(r"(\.(Q\d\w*|F16|F32|BF16))?\.gguf$", "", weights.name)


class DrainingServer(uvicorn.Server):
    """A uvicorn server that prints `kvreuse ready: URL DESCRIPTION` and `kvreuse settings: ...` (settings_line)
    once it accepts connections and,
    on a shutdown signal, has the app refuse new requests (503) while in-flight ones finish. Those still
    running `drain_timeout_s` later are cut: a 503 JSON error, or in a stream an error event and [DONE]."""

    def __init__(self, config: uvicorn.Config, description: str, drain_timeout_s: float):
        super().__init__(config)
        self.description = description
        self.drain_timeout_s = drain_timeout_s

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            # The bound address, not the configured one: port 0 picks a free port.
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            state = self.config.app.state.kvreuse
            settings = settings_line(state.config, compile_summary(state.engine.compile_states))
            print(f"kvreuse ready: http://{host}:{port}/v1 {self.description}\nkvreuse settings: {settings}",
                  flush=True)

    def handle_exit(self, sig, frame):
        self.config.app.state.kvreuse.draining = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None):
        # Left to uvicorn, the timeout cancels the request tasks: a bare 500 text/plain, or a stream cut
        # without an error or [DONE]. So the app ends them itself, first.
        cutter = asyncio.create_task(self._cut_at_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            cutter.cancel()

    async def _cut_at_deadline(self) -> None:
        await asyncio.sleep(self.drain_timeout_s)
        state = self.config.app.state.kvreuse
        cut = state.admissions.cut_all(state.engine.abort)
        logger.warning("drain timeout (server.drain_timeout_s = %s s): %d requests cut", self.drain_timeout_s, cut)
