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

from kvreuse.config import Config
from kvreuse.engine.front_end import FrontEnd
from kvreuse.server.async_engine import load_engine
from kvreuse.server.auth import load_api_keys

logger = logging.getLogger(__name__)

# After the drain deadline, the time the cut requests have to send their last bytes before uvicorn cancels
# whatever still runs (a request still uploading its body, say).
CUT_GRACE_S = 5
APP_MODULE = "kvreuse.server.app"


def serve(config: Config, *, served_model_name: str | None = None, log_level: str = "warning") -> int:
    """Serve `config`'s model over HTTP until SIGTERM or SIGINT; returns the exit code (0 once drained).
    `served_model_name` is the model id clients use (default: the weights file name without its
    quantization suffix). Raises ConfigError for a bad API key file, ModelLoadError for bad weights."""
    api_keys = load_api_keys(config.server.api_keys_file) if config.server.api_keys_file else None
    engine = load_engine(config, meanwhile=prefetch_app)
    if APP_MODULE not in sys.modules:  # the prefetch failed: import again, on one thread, from fresh directory listings
        importlib.invalidate_caches()
    from kvreuse.server.app import create_app

    model_name = served_model_name or model_name_of(engine.front_end.model_path)
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


def model_name_of(weights: Path) -> str:
    """The id a weights file is served as: SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct."""
    return re.sub(r"(\.(Q\d\w*|F16|F32|BF16))?\.gguf$", "", weights.name)


class DrainingServer(uvicorn.Server):
    """A uvicorn server that prints `kvreuse ready: URL DESCRIPTION` once it accepts connections and,
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
            print(f"kvreuse ready: http://{host}:{port}/v1 {self.description}", flush=True)

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
