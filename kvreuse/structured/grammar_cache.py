"""Compiled grammars kept for reuse, bounded by their memory rather than their number: one schema's grammar can take
tens of kilobytes or hundreds of megabytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvreuse.structured.formats import FormatSpec
from kvreuse.structured.grammar import CompiledGrammar


class GrammarCache:
    """Compiled grammars by their FormatSpec. The sum of their sizes (xgrammar's own `memory_size_bytes`, `bytes`)
    never exceeds `budget_bytes`: the least recently used go first, and a grammar larger than the whole budget is
    not kept. Thread-safe."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._entries: OrderedDict[FormatSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: FormatSpec) -> CompiledGrammar | None:
        """The kept grammar of `spec`, now the most recently used, or None."""
        with self._lock:
            grammar = self._entries.get(spec)
            if grammar is not None:
                self._entries.move_to_end(spec)
            return grammar

    def put(self, grammar: CompiledGrammar) -> bool:
        """Keep `grammar`, dropping the least recently used until it fits; False (nothing dropped) if it alone is
        larger than the budget."""
        size = grammar.memory_bytes
        with self._lock:
            if size > self.budget_bytes:
                return False
            previous = self._entries.pop(grammar.spec, None)
            if previous is not None:
                self.bytes -= previous.memory_bytes
            while self._entries and self.bytes + size > self.budget_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= dropped.memory_bytes
            self._entries[grammar.spec] = grammar
            self.bytes += size
            return True

    def check_integrity(self) -> None:
        with self._lock:
            assert self.bytes == sum(g.memory_bytes for g in self._entries.values()), "bytes is not the entries' sum"
            assert self.bytes <= self.budget_bytes, f"{self.bytes} bytes kept, over the budget of {self.budget_bytes}"
            assert all(spec == g.spec for spec, g in self._entries.items()), "a grammar is kept under another spec"
