"""Offline API: LLM(config).generate(prompts, params) and LLM.chat(messages, params)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvreuse.config import Config
from kvreuse.engine.engine import LLMEngine
from kvreuse.engine.output import RequestOutput
from kvreuse.sampling_params import SamplingParams


class LLM:
    """The offline engine. `close()` (or `with LLM(...) as llm:`) writes what is queued for the lower tiers and
    cancels a decode-step compile still running; at interpreter exit the compile is cancelled in any case."""

    def __init__(self, config: Config | None = None):
        self.engine = LLMEngine(config or Config())
        self.tokenizer = self.engine.front_end.tokenizer

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.engine.close()

    def wait_compiled(self, timeout: float | None = None) -> str:
        """Have the decode step's compiled graphs built where they are not (`engine.compile = decode`; see
        decode_graph.py) and loaded, waiting at most `timeout` seconds; its state: "compiled", "failed", "compiling"
        (timed out) or "eager" (engine.compile = off). Benchmarks call this before timing anything, so that no
        compile runs beside what they measure."""
        graph = self.engine.runner.decode_graph
        if graph is None:
            return "eager"
        self.engine.start_compile()
        graph.wait(timeout)
        return graph.state

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 cache_salt: str | None = None, use_cache: bool = True) -> list[RequestOutput]:
        """Run all prompts as one continuously batched workload; outputs come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = [self.engine.add_request(p, sp, cache_salt=cache_salt, use_cache=use_cache)
                for p, sp in zip(prompts, params, strict=True)]
        while self.engine.has_unfinished():
            self.engine.step()
        return [self.engine.output(s) for s in seqs]

    def chat(self, conversations: list[dict] | Seq[list[dict]],
             params: SamplingParams | Seq[SamplingParams] | None = None, **cache_options) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or several, under the model's chat template; text inside a
        message stays text (`FrontEnd.tokenize_chat`), unlike special-token text in a `generate` prompt."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.engine.front_end.tokenize_chat(m) for m in conversations], params, **cache_options)
