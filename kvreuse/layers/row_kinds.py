"""Which rows of the forward this thread runs compute prompt tokens, for a linear with two ways to its product
(weights/gguf_weights.py's `SplitGGUFLinear`: the GGUF kernel for few rows, the dense GEMM for many). Routed by the
row count, a cache hit's few suffix rows took the kernel where the cold prompt's many took the GEMM, and their bits
differed. Routed by kind, a prompt row takes the same product whatever its step holds, and a generated row the one a
decode step gives it (docs/design/batch-invariance.md).

The runner says a step's kinds (`row_kinds(RowKinds.of(...))`); anything else, the compiled decode step included,
runs with `GENERATED`: every row a generated one, routed as decode steps are.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

Product = Callable[[torch.Tensor], torch.Tensor]  # rows [T, in] -> [T, out]

_current = threading.local()  # .kinds: the RowKinds of the forward this thread runs


class RowKinds:
    """How one forward's rows split into prompt rows and generated rows."""

    def split(self, rows: torch.Tensor, prompt: Product, generated: Product) -> torch.Tensor:
        """rows: [T, in] -> [T, out]: the prompt rows through `prompt`, the others through `generated`."""
        raise NotImplementedError

    @staticmethod
    def of(is_prompt: list[bool], device: torch.device) -> RowKinds:
        """The kinds of a forward whose row t computes a prompt token where `is_prompt[t]`."""
        if all(is_prompt):
            return PROMPT
        if not any(is_prompt):
            return GENERATED
        mask = torch.tensor(is_prompt)
        return MixedRows(mask.nonzero()[:, 0].to(device), (~mask).nonzero()[:, 0].to(device))


class _Generated(RowKinds):
    def split(self, rows: torch.Tensor, prompt: Product, generated: Product) -> torch.Tensor:
        return generated(rows)


class _Prompt(RowKinds):
    def split(self, rows: torch.Tensor, prompt: Product, generated: Product) -> torch.Tensor:
        return prompt(rows)


class MixedRows(RowKinds):
    """A step of both kinds: decode rows riding along with prompt chunks."""

    def __init__(self, prompt_rows: torch.Tensor, generated_rows: torch.Tensor):
        self.prompt_rows, self.generated_rows = prompt_rows, generated_rows  # [P], [G]: row indices, ascending

    def split(self, rows: torch.Tensor, prompt: Product, generated: Product) -> torch.Tensor:
        from_prompt = prompt(rows[self.prompt_rows])                                  # [P, out]
        out = from_prompt.new_empty(rows.shape[0], from_prompt.shape[1])              # [T, out]
        out[self.prompt_rows] = from_prompt
        out[self.generated_rows] = generated(rows[self.generated_rows])               # [G, out]
        return out


GENERATED: RowKinds = _Generated()
PROMPT: RowKinds = _Prompt()


def current() -> RowKinds:
    """The kinds of the forward this thread runs: `GENERATED` outside `row_kinds` and inside a compiled graph."""
    if torch.compiler.is_compiling():  # the compiled decode step runs generated rows only (the runner's rule)
        return GENERATED
    return getattr(_current, "kinds", GENERATED)


@contextmanager
def row_kinds(kinds: RowKinds) -> Iterator[None]:
    """Run a forward (or a head's product) of this thread with `kinds`."""
    previous = current()
    _current.kinds = kinds
    try:
        yield
    finally:
        _current.kinds = previous
