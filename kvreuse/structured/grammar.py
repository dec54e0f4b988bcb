"""Compiled grammars and per-sequence matchers over xgrammar, for one tokenizer (compiler.py makes them)."""

from __future__ import annotations

import torch
import xgrammar as xgr

from kvreuse.layers.grammar_mask import bitmask_words, unpack_bits
from kvreuse.structured.formats import FormatSpec


class GrammarMatcher:
    """One sequence's position in its grammar. Not thread-safe: one sequence, one thread (the engine's)."""

    def __init__(self, compiled: xgr.CompiledGrammar, eos_token_ids: list[int], vocab_size: int):
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=eos_token_ids)
        self._eos = eos_token_ids
        self.vocab_size = vocab_size
        self._finished: bool | None = None   # is_finished() for the current state; None: not computed yet

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """bitmask: [rows, bitmask_words(vocab_size)] int32 on CPU; row `row` gets the allowed tokens as bits.
        Returns False when every token is allowed (nothing to mask)."""
        if self._matcher.is_terminated():  # EOS already accepted; a step after it may only repeat EOS
            bitmask[row].zero_()
            for token in self._eos:
                bitmask[row, token // 32] |= _bit(token % 32)
            return True
        return bool(self._matcher.fill_next_token_bitmask(bitmask, row))

    def fill_mask(self, mask: torch.Tensor) -> None:
        """mask: [vocab_size] bool on CPU; set True where the next token is allowed, False elsewhere. For one row at a
        time (tests, debugging): `layers.grammar_mask.apply_mask` masks a batch of logits through the engine's
        bitmask, which is faster."""
        if mask.shape != (self.vocab_size,) or mask.dtype != torch.bool:
            raise ValueError(f"mask must be [{self.vocab_size}] bool, not {list(mask.shape)} {mask.dtype}")
        bitmask = torch.empty((1, bitmask_words(self.vocab_size)), dtype=torch.int32)
        self.fill_bitmask(bitmask, 0)
        mask.copy_(torch.from_numpy(unpack_bits(bitmask[0].numpy(), self.vocab_size)))

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`. ValueError if the grammar does not allow it here (the state is unchanged)."""
        if not self._matcher.accept_token(int(token_id)):
            raise ValueError(f"token {token_id} is not allowed by the grammar here")
        self._finished = None

    def is_finished(self) -> bool:
        """True once the output is complete and nothing but EOS may follow (or EOS was accepted). A regex or choice
        whose match could still go on (`[0-9]+` after "12") is not finished: EOS and more digits are both allowed."""
        if self._finished is None:
            self._finished = self._matcher.is_terminated() or (self._matcher.is_completed() and self._only_eos())
        return self._finished

    def _only_eos(self) -> bool:
        bitmask = torch.empty((1, bitmask_words(self.vocab_size)), dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        for token in self._eos:
            bitmask[0, token // 32] &= ~_bit(token % 32)
        return not bool(bitmask.any())


class CompiledGrammar:
    """A format compiled against one tokenizer: immutable, shared by every sequence that asks for it."""

    def __init__(self, spec: FormatSpec, compiled: xgr.CompiledGrammar, eos_token_ids: list[int], vocab_size: int):
        self.spec = spec
        self._compiled = compiled
        self._eos = eos_token_ids
        self.vocab_size = vocab_size

    @property
    def memory_bytes(self) -> int:
        """What it holds in memory, by xgrammar's own account (the grammar cache's unit)."""
        return self._compiled.memory_size_bytes

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar, for one sequence."""
        return GrammarMatcher(self._compiled, self._eos, self.vocab_size)


def _bit(k: int) -> int:
    """Bit k of an int32 word as a Python int that torch stores without overflow (bit 31 is negative)."""
    return -(1 << 31) if k == 31 else 1 << k
