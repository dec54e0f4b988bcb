"""The engine: admits requests, runs schedule -> copies -> forward -> postprocess -> copies one step at a time."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from kvreuse.config import Config, SegmentConfig
from kvreuse.engine.block_io import PoolBlockIO
from kvreuse.engine.built_model import build_model
from kvreuse.engine.cpu_share import thread_policy
from kvreuse.engine.errors import RequestError
from kvreuse.engine.front_end import FrontEnd
from kvreuse.engine.model_runner import ModelRunner, StepOutput
from kvreuse.engine.output import RequestOutput, Usage
from kvreuse.engine.precompile import precompile_command
from kvreuse.engine.resolved_model import (  # noqa: F401 (DTYPES, dtype_name, resolve_dtype: importers' names)
    DTYPES,
    ResolvedModel,
    dtype_name,
    resolve_dtype,
    resolve_model,
)
from kvreuse.engine.scheduler import (  # noqa: F401 (MAX_ADMISSION_FAULTS: importers' name from here)
    MAX_ADMISSION_FAULTS,
    Scheduler,
    SchedulerFault,
    SchedulerOutput,
    StepResult,
)
from kvreuse.engine.sequence import Sequence
from kvreuse.engine.stats import DecodeGraphStatus, EngineSnapshot, EngineStats
from kvreuse.engine.stop import StopCheck
from kvreuse.engine.timings import Timings
from kvreuse.kvcache.copy_jobs import CopyJobs
from kvreuse.kvcache.events import KVEventPublisher
from kvreuse.kvcache.manager import KVCacheManager
from kvreuse.kvcache.pins import PinResult
from kvreuse.kvcache.request import CacheRequest, ReuseScope
from kvreuse.kvcache.tiers.store import TieredStore
from kvreuse.model.decode_graph import COMPILED_ROWS, DecodeGraph
from kvreuse.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """The model, its KV pool, the cache and the scheduler, with the front end that prepares their requests."""

    def __init__(self, config: Config, *, compile_later: bool = False, resolved: ResolvedModel | None = None):
        """`compile_later`: the decode step's compile waits for `start_compile()` (the server warms up first: a
        compile beside the warm-up held the GIL and both cores, and delayed the ready line by seconds). `resolved`:
        `resolve_model(config)` where the caller has it already; the model is resolved here otherwise, once."""
        self.resolved = resolved = resolved or resolve_model(config)
        self.device = resolved.device
        built = build_model(resolved)
        self.front_end = FrontEnd(config, resolved)
        front, model = self.front_end, built.model
        self.weights_description = built.weights_description
        num_blocks = front.num_kv_blocks
        decode_graph = (DecodeGraph(model, min(COMPILED_ROWS, config.engine.max_num_batched_tokens),
                                    precompile_command(resolved.model_config, resolved.max_model_len))
                        if config.engine.compile == "decode" else None)
        self.runner = ModelRunner(model, num_blocks, front.block_size, resolved.kv_format, self.device,
                                  front.tokenizer.eos_token_ids, decode_graph, front.kv_layout)
        self.tiers = TieredStore.from_config(config.cache, PoolBlockIO(self.runner.kv_cache, front.fingerprint,
                                                                         front.kv_layout))
        self.kv_manager = KVCacheManager.from_config(config.cache, num_blocks, front.fingerprint, tiers=self.tiers,
                                                     layout=front.kv_layout)
        self.segment_settings = config.cache.suffix  # immutable, replaced only by set_segment_settings
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.kv_manager, config.engine.max_num_seqs, config.engine.max_num_batched_tokens)
        self.stop = StopCheck(front.tokenizer, front.max_model_len)
        self.threads = thread_policy(config.engine)
        self.sequences: dict[str, Sequence] = {}
        # Last, so that a failure above leaves no bound port or thread behind.
        self.events = self._start_events(config)
        if not compile_later:
            self.start_compile(build=False)

    def start_compile(self, build: bool = True, wait_if_built_s: float = 0.0) -> None:
        """Load the decode step's compiled graphs in the background (engine.compile = decode), having them built
        first where they are not (`build`; otherwise the step stays eager), unless that has started already. Where
        they were built before, wait up to `wait_if_built_s` for the load (seconds), so that the first step runs
        compiled; a build is never waited for."""
        graph = self.runner.decode_graph
        if graph is not None and graph.can_start(build):
            built = graph.is_built
            graph.start(build)
            if built:
                graph.wait(wait_if_built_s)

    # The pool's and the model's shape, as the front end sized them.
    @property
    def dtype(self) -> torch.dtype:
        return self.front_end.dtype

    @property
    def dtype_description(self) -> str:
        return self.front_end.dtype_description

    @property
    def block_size(self) -> int:
        return self.front_end.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.front_end.num_kv_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.front_end.bytes_per_block

    def _start_events(self, config: Config) -> KVEventPublisher | None:
        """vLLM-format KV events of the pool (`[events] endpoint`), starting with a clear: a subscriber forgets this
        replica's previous life."""
        if not config.events.endpoint:
            return None
        events = KVEventPublisher(config.events, self.block_size, "GPU" if self.device.type == "cuda" else "CPU",
                                  windows=tuple(g.window for g in self.front_end.kv_layout.groups))
        events.all_cleared()
        events.attach(self.kv_manager.pool)
        return events

    def set_segment_settings(self, settings: SegmentConfig) -> None:
        """Segment reuse settings (`cache.suffix.*`) for the requests scheduled from now on. ValueError where the
        pool keeps only the sliding windows' K/V, which segment reuse cannot reuse."""
        if settings.enabled and self.kv_manager.windows:
            raise ValueError("segment reuse needs every layer's K/V: start with cache.sliding_kv = full")
        self.segment_settings = settings
        self.kv_manager.enable_segments = self.kv_manager.enable_caching and settings.enabled

    def add_sequence(self, seq: Sequence) -> Sequence:
        """Queue a sequence made by `front_end.make_sequence` (engine thread only)."""
        if seq.request_id in self.sequences:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        self.sequences[seq.request_id] = seq
        if seq.params.num_sequences > 1 and not seq.choices:
            seq.choices = [seq, *(self._choice(seq, i) for i in range(1, seq.params.num_sequences))]
        self.scheduler.add(seq)
        self.kv_manager.prefetch(seq.kv)  # the prefix the pool lacks, read from the lower tiers while it waits
        return seq

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, **cache_options) -> Sequence:
        """`front_end.make_sequence` + `add_sequence`."""
        return self.add_sequence(self.front_end.make_sequence(prompt, params, request_id, **cache_options))

    def _choice(self, seq: Sequence, index: int) -> Sequence:
        """Choice `index` of `seq`'s request: its prompt, its own seed stream (seed + index) and grammar state; it gets
        its K/V and first token when `seq` draws its own (Scheduler.fork)."""
        kv = CacheRequest(list(seq.prompt_token_ids), seq.kv.extra_key, ReuseScope.ANY if seq.kv.use_cache else
                          ReuseScope.NONE)
        choice = Sequence(f"{seq.request_id}#{index}", kv, seq.params, times=Timings(seq.times.arrival), index=index,
                          parent=seq, grammar=seq.grammar, cache_salt=seq.cache_salt)
        choice.generator = choice.generator or self.front_end.generator
        return choice

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        for choice in (seq.choices or [seq]) if seq is not None else []:
            if not choice.is_finished:
                self.scheduler.finish(choice, "abort")
                choice.times.finish = time.perf_counter()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """One forward: schedule -> copies -> forward -> postprocess -> copies. Returns the sequences that produced a
        token or finished in it.

        An exception inside the step fails only the sequences of that step: they finish with finish_reason
        "error" and the exception in `error`, their blocks are freed, and the engine goes on with the rest. Only
        if its state is then inconsistent (`check_integrity` fails) does the exception leave `step`."""
        batch, done = None, StepResult()
        self.threads.adjust()
        self.kv_manager.expire(self.kv_manager.clock())
        try:
            batch = self.scheduler.schedule()
            if not batch.seqs:
                self.scheduler.wait_for_head(timeout=0.05)
                return []
            self._copy(batch.copy_jobs)  # loaded and cached K/V into the admitted sequences' blocks
            step = self.runner.run(batch.seqs, self.segment_settings)
            self._record_step(batch, step)
            done = self.scheduler.postprocess(batch, step, self.stop)
            self._record_finished(done.finished)
            for jobs in done.copy_jobs:
                self._copy(jobs)
        except Exception as exc:
            fault = exc if isinstance(exc, SchedulerFault) else SchedulerFault(exc)
            if fault.done is not None:  # postprocess raised: what it finished before is reported all the same
                done = fault.done
                self._record_finished(done.finished)
            # Scheduling itself failed: every sequence it may have touched (all but those still waiting) is the step's.
            waiting = {id(s) for s in self.scheduler.waiting}
            touched = batch.seqs if batch is not None else [s for s in self.sequences.values() if id(s) not in waiting]
            failed = self._fail(touched + fault.culprits, fault.cause)
            return done.updated + [s for s in failed if all(s is not u for u in done.updated)]
        return done.updated

    def _record_step(self, batch: SchedulerOutput, step: StepOutput) -> None:
        """The step's stats, and how each sequence in its first step obtained its prompt (once, from its first
        admission): the cache's record plus the repair's outcome."""
        self.stats.record_step(self.kv_manager, batch.num_prefill_tokens)
        for seq in batch.seqs:
            if seq.reuse is None:
                seq.reuse = seq.admitted
                if seq.request_id in step.outcomes:
                    seq.reuse = step.outcomes[seq.request_id].account(seq.reuse)

    def _copy(self, jobs: CopyJobs) -> None:
        """Every tensor copy the cache asks for, in its order: tier payloads into the pool, pool blocks into pool
        blocks, pool blocks out to the tiers' write queue."""
        if jobs.writes:
            positions, payloads = zip(*jobs.writes, strict=True)
            self.tiers.io.write(positions, payloads)
        if jobs.copies:
            self.runner.copy_blocks(jobs.copies)
        for job in jobs.stores:
            self.tiers.store(job.blocks, job.positions, job.tiers)

    def _fail(self, seqs: list[Sequence], exc: Exception) -> list[Sequence]:
        """Finish the unfinished of `seqs` with finish_reason "error" and free their blocks; returns them. Like
        aborted requests, they are not added to the stats."""
        groups = [s.parent or s for s in seqs]  # a choice fails with its whole request
        failed = list({id(c): c for g in groups for c in (g.choices or [g]) if not c.is_finished}.values())
        logger.error("a step failed; failing its %d request(s): %s", len(failed),
                     " ".join(s.request_id for s in failed), exc_info=exc)
        now = time.perf_counter()
        for seq in failed:
            seq.error = f"the engine failed while computing this request: {type(exc).__name__}: {exc}"
            seq.times.finish = now
            self.scheduler.finish(seq, "error")
            self.sequences.pop(seq.group_id, None)
        self.check_integrity()  # blocks published by earlier steps were computed whole: the cache stays valid
        return failed

    def _record_finished(self, finished: list[Sequence]) -> None:
        """Sequences the postprocess finished: a request whose every choice is done leaves the engine, each adds its
        record to the stats, and each request logs its cache hit."""
        for seq in finished:
            if seq.group_finished:
                self.sequences.pop(seq.group_id, None)
            self.stats.record_finished(seq)
            if seq.index == 0:
                reuse = " ".join(f"{k}={v}" for k, v in seq.reuse_or_planned.as_dict().items())
                logger.info("cache-hit request=%s %s completion=%d ttft_ms=%.1f finish=%s hit_rate_total=%.3f",
                            seq.request_id, reuse, seq.num_completion_tokens, (seq.times.ttft_s or 0) * 1000,
                            seq.finish_reason, self.stats.reuse.hit_rate)

    def output(self, seq: Sequence) -> RequestOutput:
        """The output of the request `seq` started (its choice 0): with n > 1, every choice returned is in `choices`
        (with best_of, the n of highest cumulative logprob, re-indexed)."""
        if not seq.choices:
            return RequestOutput.from_sequence(seq)
        ranked = seq.choices
        if seq.params.ranks_choices:
            ranked = sorted(seq.choices, key=lambda c: c.cumulative_logprob, reverse=True)[:seq.params.n]
        # The prompt is choice 0's: its prompt logprobs (echo) stand for every choice, and the usage counts it once
        # (the other choices' records are empty), with the tokens of every choice generated.
        prompt_logprobs = list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None
        outputs = [replace(RequestOutput.from_sequence(c, index=i), prompt_logprobs=prompt_logprobs)
                   for i, c in enumerate(ranked)]
        usage = sum((Usage.of(c) for c in seq.choices[1:]), Usage.of(seq))
        return replace(outputs[0], usage=usage, choices=outputs if len(outputs) > 1 else [])

    def stats_snapshot(self) -> EngineSnapshot:
        """Engine state and accounting now: the only view of the engine that metrics and logs read."""
        graph, front, running = self.runner.decode_graph, self.front_end, self.scheduler.running
        group_blocks = self.kv_manager.num_blocks_in_use_by_group([s.kv for s in running])
        return self.stats.snapshot(
            self.kv_manager, front.bytes_per_block, num_requests_running=len(running),
            num_requests_waiting=len(self.scheduler.waiting), kv_capacity_tokens=front.kv_capacity_tokens,
            threads=self.threads.threads,
            group_windows=tuple(g.window for g in front.kv_layout.groups),
            group_tokens_in_use=tuple(n * self.block_size for n in group_blocks),
            decode_graph=DecodeGraphStatus(graph.state, graph.num_steps, graph.compile_s) if graph else None,
            tiers=self.tiers.snapshot() if self.tiers is not None else None,
            pins=self.kv_manager.pins.snapshot(time.monotonic()),
            sessions=self.kv_manager.pool.retention.snapshot(self.kv_manager.clock()),
            events=self.events.snapshot() if self.events is not None else None)

    def reset_prefix_cache(self, tiers: bool = False) -> dict[str, int]:
        """Drop the pool's cached blocks that no request holds (and with `tiers`, every lower tier's entries);
        how many per tier. Engine thread only."""
        dropped = {"memory": self.kv_manager.pool.reset_cache()}
        if tiers and self.tiers is not None:
            dropped.update(self.tiers.clear())
        return dropped

    def pin_prompt(self, token_ids: list[int], cache_salt: str | None = None, ttl_s: int | None = None,
                   tenant: str | None = None, num_tenants: int = 1) -> PinResult:
        """Pin the pool's cached chain of this prompt (as a request with `cache_salt` would hit it) for `tenant`, for
        `ttl_s` seconds (None: `cache.pin_ttl_s`; 0: until unpinned), within `cache.pin_max_share` of the pool and
        within the tenant's share of that, split among `num_tenants` (the server's API key tenants). Engine thread
        only."""
        req = self.kv_manager.new_request(token_ids, cache_salt)
        cache = self.front_end.config.cache
        if not self.kv_manager.can_pin(req, tenant, num_tenants):
            share = f"cache.pin_max_share = {cache.pin_max_share}"
            return PinResult(0, self.kv_manager.pins.refusal(tenant, num_tenants, share))
        ttl = cache.pin_ttl_s if ttl_s is None else ttl_s
        num_tokens = self.kv_manager.pin(req, None if ttl == 0 else time.monotonic() + ttl, tenant, num_tenants)
        return PinResult(num_tokens, None if num_tokens else "nothing of the prompt is cached")

    def unpin_all(self) -> int:
        """End every pin; how many blocks they held (now cached like any block). Engine thread only."""
        return self.kv_manager.pins.unpin_all()

    def close(self) -> None:
        """Cancel a decode-step compile still running, stop the grammar check process, write what is queued for the
        lower tiers and the KV events, and stop their threads."""
        if self.runner.decode_graph is not None:
            self.runner.decode_graph.close()
        self.front_end.close()
        if self.tiers is not None:
            self.tiers.close()
        if self.events is not None:
            self.events.close()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
