"""The engine: admits requests, runs scheduler -> model runner -> postprocess one step at a time."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from kvreuse.config import Config
from kvreuse.engine.model_runner import ModelRunner
from kvreuse.engine.output import RequestOutput
from kvreuse.engine.scheduler import Scheduler
from kvreuse.engine.sequence import Sequence
from kvreuse.engine.stats import EngineStats
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.kvcache.normalize import normalize_text
from kvreuse.model.llama import Llama
from kvreuse.model.loader import load_weights
from kvreuse.model.tokenizer import Tokenizer
from kvreuse.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class RequestError(ValueError):
    """A request the engine refuses; the message names the field and the limit."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device = cuda, but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    # Measured on the 2-core AVX2 CI machine (no native bf16): fp32 is faster there; bf16 wins on GPUs.
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class LLMEngine:
    def __init__(self, config: Config):
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        weights = load_weights(config.model.path or None)
        self.model_path = weights.path
        self.model_args = weights.args
        # Cache keys must change whenever the numbers in the KV would: weights and dtype.
        self.fingerprint = f"{weights.fingerprint}:{str(self.dtype).removeprefix('torch.')}"
        self.tokenizer = Tokenizer.load(weights.path, weights.fingerprint)
        model = Llama.from_weights(weights, self.dtype, self.device)
        del weights

        self.block_size = config.cache.block_size
        num_blocks = config.engine.num_kv_blocks or self._blocks_for_memory(config.engine.kv_cache_memory_mb)
        self.runner = ModelRunner(model, num_blocks, self.block_size, self.dtype, self.device)
        cache = config.cache
        self.kv_manager = KVCacheManager(
            num_blocks, self.block_size, enable_caching=cache.enabled, max_cached_blocks=cache.max_blocks,
            policy=cache.policy, min_match_blocks=cache.min_match_blocks, fingerprint=self.fingerprint,
            enable_segments=cache.suffix.enabled,
        )
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.kv_manager, config.engine.max_num_seqs, config.engine.max_num_batched_tokens)
        self.num_kv_blocks = num_blocks
        self.max_model_len = min(config.server.max_tokens, self.model_args.max_position_embeddings)
        self.sequences: dict[str, Sequence] = {}
        self._request_counter = itertools.count()

    def _blocks_for_memory(self, megabytes: int) -> int:
        a = self.model_args
        bytes_per_block = a.num_layers * 2 * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize
        return max(1, megabytes * 2**20 // bytes_per_block)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def normalize(self, text: str) -> str:
        return normalize_text(text) if self.config.cache.normalize_input else text

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text for a conversation; with normalize_input, each message is normalized first."""
        messages = [{**m, "content": self.normalize(m["content"])} if isinstance(m.get("content"), str) else m
                    for m in messages]
        return self.tokenizer.apply_chat_template(messages)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(self.normalize(prompt))
        if not all(isinstance(t, int) and 0 <= t < self.model_args.vocab_size for t in prompt):
            raise RequestError(f"prompt token ids must be integers in [0, {self.model_args.vocab_size})")
        return list(prompt)

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, *, cache_salt: str | None = None,
                      use_cache: bool = True) -> Sequence:
        """Tokenize and validate a request without touching engine state (safe from any thread); raises
        RequestError naming the problem. Requests with different `cache_salt` never share KV;
        `use_cache=False` opts out of reuse."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        params = params or SamplingParams(max_tokens=self.config.server.default_max_tokens)
        token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise RequestError("prompt is empty")
        self.check_fits(len(token_ids), params.max_tokens)
        request_id = request_id or f"req-{next(self._request_counter)}"
        return Sequence(request_id, token_ids, params, cache_salt=cache_salt, use_cache=use_cache)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        needed = num_prompt_tokens + max_tokens
        if needed > self.max_model_len:
            raise RequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {needed} tokens exceeds "
                f"the context limit of {self.max_model_len} tokens (server.max_tokens)"
            )
        if needed > self.kv_capacity_tokens:
            raise RequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {needed} tokens does not fit "
                f"in the KV pool of {self.kv_capacity_tokens} tokens (engine.num_kv_blocks x cache.block_size)"
            )

    def add_sequence(self, seq: Sequence) -> Sequence:
        """Queue a sequence made by `make_sequence` (engine thread only)."""
        if seq.request_id in self.sequences:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, **cache_options) -> Sequence:
        """`make_sequence` + `add_sequence`."""
        return self.add_sequence(self.make_sequence(prompt, params, request_id, **cache_options))

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            seq.finish_time = time.perf_counter()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """One forward. Returns the sequences that produced a token or finished in it."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        token_ids = self.runner.run(batch.seqs, self.config.cache.suffix)
        for seq in batch.seqs:
            self.kv_manager.release_sources(seq)  # reused K/V are copied into the sequence's own blocks now
        now = time.perf_counter()
        self.stats.record_step(self.kv_manager, batch.num_prefill_tokens)
        updated = []
        for seq, token_id in zip(batch.seqs, token_ids, strict=True):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.kv_manager.cache_computed_blocks(seq)
            if token_id is None:
                continue
            seq.token_ids.append(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._check_finished(seq, token_id, now)
            updated.append(seq)
        return updated

    def _check_finished(self, seq: Sequence, token_id: int, now: float) -> None:
        params = seq.params
        reason = None
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            reason = "stop"
        text = self.tokenizer.decode(seq.completion_token_ids)
        cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, reason = text[:cut], "stop"
        seq.output_text = text
        if reason is None and (seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_time = now
            self.scheduler.finish(seq, reason)
            self.sequences.pop(seq.request_id, None)
            self.stats.record_finished(seq)
            logger.info("cache-hit request=%s prompt=%d cached=%d reused=%d (shifted=%d) recomputed=%d computed=%d "
                        "guarded=%s completion=%d ttft_ms=%.1f finish=%s hit_rate_total=%.3f", seq.request_id,
                        seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_reused_tokens, seq.num_shifted_tokens,
                        seq.num_recomputed_tokens, seq.num_computed_prompt_tokens, seq.guarded,
                        seq.num_completion_tokens, seq.ttft_s * 1000, reason, self.stats.hit_rate)

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput.from_sequence(seq)

    def stats_snapshot(self) -> dict:
        return self.stats.snapshot(self.kv_manager, self.runner.bytes_per_block)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
