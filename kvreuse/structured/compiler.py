"""Response formats checked against `[structured]`'s limits and compiled into grammars, for one tokenizer.

A new format goes through, in order: its size (limits.py: bytes, properties), then, with a
`structured.compile_timeout_s`, its compile timed in the check process (killed at the deadline), then its compile
here; the grammar is kept in a cache bounded by bytes. How each format fared in the check is remembered, so a
format that ran past the deadline is refused at once when it comes again.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import xgrammar as xgr

from kvreuse.background import lower_priority
from kvreuse.config import StructuredConfig
from kvreuse.structured.check_process import CompileCheck, Verdict
from kvreuse.structured.compile_call import compile_format, new_compiler
from kvreuse.structured.errors import UnsupportedFormat, engine_message
from kvreuse.structured.formats import CheckedFormat, FormatSpec
from kvreuse.structured.grammar import CompiledGrammar
from kvreuse.structured.grammar_cache import GrammarCache
from kvreuse.structured.limits import check_limits
from kvreuse.weights.tokenizer import Tokenizer

VERDICTS_KEPT = 4096  # formats whose check outcome is remembered (a digest and a number each)
COMPILE_JOBS = 4  # compiles for use at once (each on a thread of low priority, see background.py)


class GrammarCompiler:
    """Checks and compiles FormatSpecs for one tokenizer. Thread-safe: requests are prepared on several threads.
    No lock is held while compiling, so one large schema stalls no other request (two threads compiling one spec
    both compile it; the second result is kept), and compiles run at a low CPU priority (background.py). Every
    refusal is an UnsupportedFormat naming the request field, and a limit's refusal its key."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: StructuredConfig | None = None):
        self.vocab_size = vocab_size
        self.limits = limits or StructuredConfig()
        self._eos = sorted(tokenizer.eos_token_ids)
        # vocab_size is the logits width: ids from the tokenizer's size up to it are padding, never allowed.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size, stop_token_ids=self._eos)
        self._compiler = new_compiler(info)
        self.cache = GrammarCache(self.limits.grammar_cache_mb * 2**20)
        self.check_process = CompileCheck(info) if self.limits.compile_timeout_s > 0 else None
        self._verdicts: OrderedDict[bytes, Verdict] = OrderedDict()  # sha256 of the spec -> how its check went
        self._lock = threading.Lock()
        self._compile_threads = ThreadPoolExecutor(COMPILE_JOBS, thread_name_prefix="kvreuse-grammar-compile",
                                                   initializer=lower_priority)

    def check(self, spec: FormatSpec | CheckedFormat) -> CheckedFormat:
        """`spec` within the limits and (with a compile timeout) known to compile in time, without compiling it
        here: what an ingress that decodes nothing needs. A CheckedFormat is returned as it is."""
        if isinstance(spec, CheckedFormat):
            return spec
        check_limits(spec, self.limits)
        if self.check_process is not None:
            self._refuse_unless_in_time(spec)
        return CheckedFormat(spec)

    def compile(self, fmt: FormatSpec | CheckedFormat) -> CompiledGrammar:
        """The grammar of `fmt`, from the cache or compiled after `check`. A CheckedFormat (checked by a cluster's
        ingress) is only held to the size limits again, not timed a second time."""
        spec = fmt.spec if isinstance(fmt, CheckedFormat) else fmt
        found = self.cache.get(spec)
        if found is not None:
            return found
        if isinstance(fmt, CheckedFormat):
            check_limits(spec, self.limits)
        else:
            self.check(spec)
        try:
            compiled = self._compile_threads.submit(compile_format, self._compiler, spec).result()
        except Exception as exc:  # xgrammar raises RuntimeError (and may raise others) for what it refuses
            raise UnsupportedFormat(spec.field, f"{spec.kind}: {engine_message(exc)}") from None
        grammar = CompiledGrammar(spec, compiled, self._eos, self.vocab_size)
        self.cache.put(grammar)
        return grammar

    def close(self) -> None:
        """Stop the check process (a later check starts it again)."""
        if self.check_process is not None:
            self.check_process.close()

    def _refuse_unless_in_time(self, spec: FormatSpec) -> None:
        key = hashlib.sha256(f"{spec.kind}\x00{spec.value}".encode()).digest()
        with self._lock:
            verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self.check_process.run(spec, self.limits.compile_timeout_s)
            with self._lock:
                self._verdicts[key] = verdict
                while len(self._verdicts) > VERDICTS_KEPT:
                    self._verdicts.popitem(last=False)
        if isinstance(verdict, str):
            raise UnsupportedFormat(spec.field, f"{spec.kind}: {verdict}")
        if verdict == math.inf:
            raise UnsupportedFormat(spec.field, f"{spec.field}: this {spec.noun} takes longer than "
                                                f"{self.limits.compile_timeout_s:g} s to compile "
                                                f"(structured.compile_timeout_s); fewer optional properties, smaller "
                                                f"repetition counts or no minProperties/maxProperties compile faster")
