"""The engine: admits requests, runs scheduler -> model runner -> postprocess one step at a time."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace

import torch

from kvreuse.config import Config, SuffixConfig
from kvreuse.engine.block_io import PoolBlockIO
from kvreuse.engine.detokenizer import detokenize, find_stop, stop_search_start
from kvreuse.engine.model_runner import ModelRunner, kv_bytes_per_block
from kvreuse.engine.output import RequestOutput
from kvreuse.engine.repair import RepairOutcome
from kvreuse.engine.scheduler import Scheduler
from kvreuse.engine.sequence import Sequence
from kvreuse.engine.stats import EngineStats
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.kvcache.normalize import normalize_text
from kvreuse.kvcache.tiers.store import TieredStore
from kvreuse.model import dtype_probe
from kvreuse.model.llama import Llama
from kvreuse.model.loader import ModelArgs, load_weights
from kvreuse.model.tokenizer import ChatText, Tokenizer, check_unicode
from kvreuse.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class RequestError(ValueError):
    """A request the engine refuses; the message names the field and the limit. `field` is the request field it is
    about (prompt, messages, stop, cache_salt), `code` a machine-readable reason (context_length_exceeded) or None."""

    def __init__(self, message: str, field: str = "prompt", code: str | None = None):
        super().__init__(message)
        self.field, self.code = field, code


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device = cuda, but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, args: ModelArgs) -> tuple[torch.dtype, str]:
    """The dtype of the weights and KV, and why (empty for an explicit `model.dtype`): `auto` is bf16 on CUDA
    and, on a CPU, whichever dtype the probe measured faster on `args`' prefill-shaped GEMMs (logged at INFO)."""
    if name != "auto":
        return DTYPES[name], ""
    if device.type == "cuda":
        return torch.bfloat16, "auto: cuda"
    result = dtype_probe.probe(args)
    logger.info("model.dtype = auto: %s on this CPU; %s", dtype_name(result.dtype), result.describe())
    return result.dtype, f"auto: {result.summary}"


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


class LLMEngine:
    def __init__(self, config: Config):
        self.config = config
        self.device = resolve_device(config.model.device)
        weights = load_weights(config.model.path or None)
        self.dtype, why = resolve_dtype(config.model.dtype, self.device, weights.args)
        self.dtype_description = f"{dtype_name(self.dtype)} ({why})" if why else dtype_name(self.dtype)
        self.model_path = weights.path
        self.model_args = weights.args
        # Cache keys must change whenever the numbers in the KV would: weights and dtype.
        self.fingerprint = f"{weights.fingerprint}:{str(self.dtype).removeprefix('torch.')}"
        self.tokenizer = Tokenizer.load(weights.path, weights.fingerprint)
        model = Llama.from_weights(weights, self.dtype, self.device)
        del weights

        self.block_size = config.cache.block_size
        self.bytes_per_block = kv_bytes_per_block(self.model_args, self.block_size, self.dtype)
        num_blocks = config.engine.num_kv_blocks or max(1, config.engine.kv_cache_memory_mb * 2**20
                                                        // self.bytes_per_block)
        self.runner = ModelRunner(model, num_blocks, self.block_size, self.dtype, self.device)
        self.tiers = TieredStore.from_config(config.cache, PoolBlockIO(self.runner.kv_cache, self.fingerprint))
        self.kv_manager = KVCacheManager.from_config(config.cache, num_blocks, self.fingerprint, tiers=self.tiers)
        self.reuse = config.cache.suffix  # segment reuse settings: immutable, replaced only by set_reuse
        # Sampling of requests that bring no seed of their own draws from here: a run is reproducible.
        self.generator = torch.Generator().manual_seed(config.engine.seed)
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.kv_manager, config.engine.max_num_seqs, config.engine.max_num_batched_tokens)
        self.num_kv_blocks = num_blocks
        self.max_model_len = min(config.server.max_tokens, self.model_args.max_position_embeddings)
        self.sequences: dict[str, Sequence] = {}
        self._request_counter = itertools.count()

    def set_reuse(self, settings: SuffixConfig) -> None:
        """Segment reuse settings (`cache.suffix.*`) for the requests scheduled from now on."""
        self.reuse = settings
        self.kv_manager.enable_segments = self.kv_manager.enable_caching and settings.enabled

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def normalize(self, text: str) -> str:
        return normalize_text(text) if self.config.cache.normalize_input else text

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text for a conversation (what `tokenize_chat` tokenizes); with normalize_input, each message
        is normalized first."""
        return self._chat_text(messages).text

    def _chat_text(self, messages: list[dict]) -> ChatText:
        messages = [{**m, "content": self.normalize(m["content"])} if isinstance(m.get("content"), str) else m
                    for m in messages]
        return self.tokenizer.render_chat(messages)

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        """The prompt tokens of a conversation under the chat template: only the template's own markers become
        special tokens; text inside a message is text, so it cannot forge a role or end a turn. RequestError
        (field `messages`) for invalid Unicode and for a prompt too long by its character count alone."""
        chat = self._chat_text(messages)
        self._check_text(chat.text, "messages")
        return self.tokenizer.encode_chat(chat)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """The tokens of a raw prompt: a text is the caller's whole text (special-token text in it is the special
        token; a conversation goes through `tokenize_chat`), token ids are checked against the vocabulary.
        RequestError (field `prompt`) for invalid Unicode and for a text too long by its character count alone."""
        if isinstance(prompt, str):
            text = self.normalize(prompt)
            self._check_text(text, "prompt")
            return self.tokenizer.encode(text)
        if not all(isinstance(t, int) and 0 <= t < self.model_args.vocab_size for t in prompt):
            raise RequestError(f"prompt token ids must be integers in [0, {self.model_args.vocab_size})")
        return list(prompt)

    def _check_text(self, text: str, field: str) -> None:
        """Before tokenizing: valid Unicode, and not so many characters that the tokens alone fill the context.
        Tokenizing costs about a second and hundreds of MB per million characters; these checks, one scan."""
        try:
            check_unicode(text)
        except ValueError as exc:
            raise RequestError(f"{field}: {exc}", field) from None
        least = self.tokenizer.min_tokens(text)
        if least >= self.max_model_len:  # not even one completion token would fit
            rendered = " (rendered with the chat template)" if field == "messages" else ""
            raise RequestError(
                f"{field}: {len(text):,} characters{rendered} need at least {least:,} tokens (no token of this model "
                f"covers more than {self.tokenizer.max_token_chars} characters), which leaves no room for a "
                f"completion within the context limit of {self.max_model_len} tokens (server.max_tokens)", field,
                "context_length_exceeded")

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, *, cache_salt: str | None = None,
                      use_cache: bool = True) -> Sequence:
        """Tokenize and validate a request without touching engine state (safe from any thread); raises
        RequestError naming the problem. Requests with different `cache_salt` never share KV;
        `use_cache=False` opts out of reuse."""
        if cache_salt is not None:
            if not isinstance(cache_salt, str):
                raise RequestError(f"cache_salt must be a string, got {type(cache_salt).__name__}", "cache_salt")
            try:
                check_unicode(cache_salt)  # it is hashed as UTF-8
            except ValueError as exc:
                raise RequestError(f"cache_salt: {exc}", "cache_salt") from None
        params = params or SamplingParams(max_tokens=self.config.server.default_max_tokens)
        self._check_stops(params.stop)
        token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise RequestError("prompt is empty")
        self.check_fits(len(token_ids), params.max_tokens)
        request_id = request_id or f"req-{next(self._request_counter)}"
        seq = Sequence(request_id, self.kv_manager.new_request(list(token_ids), cache_salt, use_cache), params)
        seq.generator = seq.generator or self.generator
        return seq

    def _check_stops(self, stops: list[str]) -> None:
        # Every step searches the new text for every stop string: their number and length bound that work.
        limits = self.config.server
        if len(stops) > limits.max_stop_strings:
            raise RequestError(f"stop: {len(stops)} stop strings, at most {limits.max_stop_strings} allowed "
                               f"(server.max_stop_strings)", "stop")
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_chars:
            raise RequestError(f"stop: a stop string of {longest} characters, at most {limits.max_stop_chars} "
                               f"allowed (server.max_stop_chars)", "stop")

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        needed = num_prompt_tokens + max_tokens
        if needed > self.max_model_len:
            raise RequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {needed} tokens exceeds "
                f"the context limit of {self.max_model_len} tokens (server.max_tokens)", code="context_length_exceeded"
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
        self.kv_manager.prefetch(seq.kv)  # the prefix the pool lacks, read from the lower tiers while it waits
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
        """One forward. Returns the sequences that produced a token or finished in it.

        An exception inside the step fails only the sequences of that step: they finish with finish_reason
        "error" and the exception in `error`, their blocks are freed, and the engine goes on with the rest. Only
        if its state is then inconsistent (`check_integrity` fails) does the exception leave `step`."""
        batch, updated = None, []
        try:
            batch = self.scheduler.schedule()
            if batch.seqs:
                self._run(batch.seqs, batch.num_prefill_tokens, updated)
            else:
                self.scheduler.wait_for_head(timeout=0.05)
        except Exception as exc:
            # Scheduling itself failed: every sequence it may have touched (all but those still waiting) is the step's.
            waiting = {id(s) for s in self.scheduler.waiting}
            touched = batch.seqs if batch is not None else [s for s in self.sequences.values() if id(s) not in waiting]
            updated += [s for s in self._fail(touched, exc) if all(s is not u for u in updated)]
        return updated

    def _run(self, seqs: list[Sequence], num_prefill_tokens: int, updated: list[Sequence]) -> None:
        """The forward and its postprocess; appends to `updated` as it goes, so that if it raises, the sequences
        that already finished are still reported."""
        token_ids, outcomes = self.runner.run(seqs, self.reuse)
        now = time.perf_counter()
        self.stats.record_step(self.kv_manager, num_prefill_tokens)
        for seq, token_id in zip(seqs, token_ids, strict=True):
            self._account(seq, outcomes.get(seq.request_id))
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.kv_manager.cache_computed_blocks(seq.kv, seq.num_computed_tokens)
            if token_id is None:
                continue
            seq.token_ids.append(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._check_finished(seq, token_id, now)
            updated.append(seq)

    def _fail(self, seqs: list[Sequence], exc: Exception) -> list[Sequence]:
        """Finish the unfinished of `seqs` with finish_reason "error" and free their blocks; returns them. Like
        aborted requests, they are not added to the stats."""
        failed = [s for s in seqs if not s.is_finished]
        logger.error("a step failed; failing its %d request(s): %s", len(failed),
                     " ".join(s.request_id for s in failed), exc_info=exc)
        now = time.perf_counter()
        for seq in failed:
            seq.error = f"the engine failed while computing this request: {type(exc).__name__}: {exc}"
            seq.finish_time = now
            self.scheduler.finish(seq, "error")
            self.sequences.pop(seq.request_id, None)
        self.check_integrity()  # blocks published by earlier steps were computed whole: the cache stays valid
        return failed

    def _account(self, seq: Sequence, outcome: RepairOutcome | None) -> None:
        """After a sequence's step: its reuse record (once, from its first admission's plan and the repair), and
        the plan's sources let go (their K/V are copied into the sequence's own blocks now)."""
        kv = seq.kv
        if seq.reuse is None:
            plan = kv.segment_plan
            seq.reuse = ReuseRecord.planned(seq.num_prompt_tokens, kv.num_cached_tokens,
                                            plan.num_tokens if plan else 0, plan.num_shifted_tokens if plan else 0,
                                            kv.num_loaded_tokens)
            if outcome is not None:
                seq.reuse = replace(seq.reuse, recomputed_tokens=outcome.num_recomputed_tokens,
                                    discarded_tokens=outcome.num_discarded_tokens,
                                    guarded_requests=int(outcome.guarded))
        if outcome is not None and outcome.exact:
            kv.num_exact_tokens = None  # every reused token was recomputed: the whole KV is exact
        self.kv_manager.release_sources(kv)

    def _check_finished(self, seq: Sequence, token_id: int, now: float) -> None:
        """Detokenize the new token (incrementally) and finish on EOS, a stop string, max_tokens or the context
        limit. Stops are searched only where the new text can complete one, with the same result as searching
        the whole text every step (see detokenizer.py)."""
        params = seq.params
        reason = None
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            reason = "stop"
        search_from = stop_search_start(len(seq.output_text), params.stop)
        pending = detokenize(self.tokenizer, seq)    # a character still cut short, if any
        text = seq.output_text + pending
        cut = find_stop(text, params.stop, search_from) if params.stop else -1
        if cut >= 0:
            text, reason = text[:cut], "stop"
        elif reason is None and (seq.num_completion_tokens >= params.max_tokens
                                 or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.output_text = text  # what decoding the whole completion gives, a cut-short character as U+FFFD
            seq.finish_time = now
            self.scheduler.finish(seq, reason)
            self.sequences.pop(seq.request_id, None)
            self.stats.record_finished(seq)
            reuse = " ".join(f"{k}={v}" for k, v in seq.reuse_or_planned.as_dict().items())
            logger.info("cache-hit request=%s %s completion=%d ttft_ms=%.1f finish=%s hit_rate_total=%.3f",
                        seq.request_id, reuse, seq.num_completion_tokens, (seq.ttft_s or 0) * 1000, reason,
                        self.stats.reuse.hit_rate)

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput.from_sequence(seq)

    def stats_snapshot(self) -> dict:
        """Engine state and accounting as one flat dict: the only view of the engine that metrics and logs read.
        With lower tiers, `tiers` holds their counters (TieredStore.snapshot)."""
        snapshot = {**self.stats.snapshot(self.kv_manager, self.bytes_per_block),
                    "num_requests_running": len(self.scheduler.running),
                    "num_requests_waiting": len(self.scheduler.waiting)}
        if self.tiers is not None:
            snapshot["tiers"] = self.tiers.snapshot()
        return snapshot

    def reset_prefix_cache(self, tiers: bool = False) -> dict[str, int]:
        """Drop the pool's cached blocks that no request holds (and with `tiers`, every lower tier's entries);
        how many per tier. Engine thread only."""
        dropped = {"memory": self.kv_manager.pool.reset_cache()}
        if tiers and self.tiers is not None:
            dropped.update(self.tiers.clear())
        return dropped

    def close(self) -> None:
        """Write what is queued for the lower tiers, and stop their threads."""
        if self.tiers is not None:
            self.tiers.close()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
