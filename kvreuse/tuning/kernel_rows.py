"""Up to how many rows a step's linears read the GGUF blocks (the kernel) rather than the dense weight, measured once
per CPU on the model's own linears and kept on disk, as the dtype probe is. The kernel streams a fifth to a third of
the dense bytes, and past some row count the dense GEMM's blocking may win; where depends on the CPU
(docs/benchmarks.md). Where the kernel keeps up at a prefill's row count too, every row takes it: one summation order
per row whatever the batch (docs/design/batch-invariance.md), and one copy of the weights."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from kvreuse.cache_dir import keyed_path, read_keyed, write_json_atomically
from kvreuse.kernels import build as kernels
from kvreuse.tuning.dtype_probe import cpu_identity

PROBE_VERSION = 4  # 3: passes from evicted caches; 4: PREFILL_ROWS
# The row limits to choose from: the compiled graphs' row boundaries (decode_graph.BRANCHING_ROW_GRID), so that no
# graph straddles the linears' branch. The first is not measured: up to 16 rows the kernel was faster in fp32 on
# every CPU measured (docs/benchmarks.md).
ROW_LIMITS = (16, 32, 64)
MIN_GAIN = 1.1         # the kernel takes a limit's rows only if it is this much faster there: a tie is noise
PREFILL_ROWS = 256     # a prefill chunk's rows, where the kernel must keep up to take every row
MAX_PREFILL_COST = 1.1  # ... at most this many times the dense GEMM's time there (batch invariance's price)
MEASURED_LAYERS = 6    # layers sampled evenly: their linears at 64 rows take ~10-15 ms a pass on a 2-core Xeon
REPEATS = 5
EVICT_BYTES = 64 << 20


class BlockLinear(Protocol):
    """What the probe reads of a GGUF linear (gguf_weights.py's `SplitGGUFLinear` has it): tuning/ sits below
    the weights and measures what it is handed."""
    in_features: int
    out_features: int
    bits: int
    group: int
    isa: int
    weight: torch.Tensor

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor: ...

    def dense_product(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class RowTimes:
    """Seconds (the fastest pass) for the sampled linears at `rows` rows, through the kernel and the dense weight."""
    rows: int
    kernel_s: float
    dense_s: float


@dataclass(frozen=True)
class KernelRows:
    limit: int
    every_row: bool  # every row takes the kernel (then `limit` is moot)
    times: tuple[RowTimes, ...]
    from_cache: bool

    @property
    def summary(self) -> str:
        """For the weights line: `kernel up to 32 rows (kernel/dense 0.80 at 32, ...; cached)` or `every row through
        the kernel (...)`."""
        ratios = ", ".join(f"{t.kernel_s / t.dense_s:.2f} at {t.rows}" for t in self.times)
        rows = "every row through the kernel" if self.every_row else f"kernel up to {self.limit} rows"
        return f"{rows} (kernel/dense {ratios}; {'cached' if self.from_cache else 'measured'})"


def choose_limit(times: Sequence[RowTimes]) -> int:
    """The largest of ROW_LIMITS up to which the kernel was MIN_GAIN times faster at every measured row count."""
    limit = ROW_LIMITS[0]
    for t in sorted((t for t in times if t.rows in ROW_LIMITS), key=lambda t: t.rows):
        if t.kernel_s * MIN_GAIN > t.dense_s:
            break
        limit = t.rows
    return limit


def choose_every_row(times: Sequence[RowTimes]) -> bool:
    """Whether the kernel took at most MAX_PREFILL_COST times the dense GEMM's time at PREFILL_ROWS rows."""
    return any(t.rows == PREFILL_ROWS and t.kernel_s <= MAX_PREFILL_COST * t.dense_s for t in times)


def chosen(times: tuple[RowTimes, ...], from_cache: bool) -> KernelRows:
    return KernelRows(choose_limit(times), choose_every_row(times), times, from_cache)


def sampled(layers: Sequence[Sequence[BlockLinear]]) -> list[BlockLinear]:
    """The GGUF linears of MEASURED_LAYERS layers spread evenly over the model (`layers`: each layer's)."""
    step = max(1, len(layers) // MEASURED_LAYERS)
    return [lin for linears in layers[::step][:MEASURED_LAYERS] for lin in linears]


def measure(linears: Sequence[BlockLinear]) -> tuple[RowTimes, ...]:
    """Time `linears` at each measured limit's rows and at PREFILL_ROWS, kernel and dense interleaved (alternating
    which goes first): one warm-up, then the fastest of REPEATS (another process's load only ever adds time). Each
    pass starts from caches that hold none of its weights, as in a step, where every linear's weights were evicted by
    the others'."""
    g = torch.Generator().manual_seed(0)
    counts = (*ROW_LIMITS[1:], PREFILL_ROWS)
    inputs = {(rows, lin.in_features): torch.randn(rows, lin.in_features, generator=g).to(lin.weight.dtype)
              for rows in counts for lin in linears}
    dense_bytes = sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)
    evict = torch.ones(max(EVICT_BYTES, 2 * dense_bytes) // 4)  # read between passes: more than any cache holds

    def one_pass(rows: int, kernel: bool) -> float:
        pairs = [(lin, inputs[rows, lin.in_features]) for lin in linears]
        evict.sum()
        t0 = time.perf_counter()
        for lin, x in pairs:
            lin.kernel_product(x) if kernel else lin.dense_product(x)
        return time.perf_counter() - t0

    kinds = [(rows, kernel) for rows in counts for kernel in (True, False)]
    samples: dict[tuple[int, bool], list[float]] = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for kind in kinds:
            one_pass(*kind)
        for repeat in range(REPEATS):
            for kind in (kinds if repeat % 2 == 0 else kinds[::-1]):
                samples[kind].append(one_pass(*kind))
    return tuple(RowTimes(rows, min(samples[rows, True]), min(samples[rows, False]))
                 for rows in counts)


def probe_key(linears: Sequence[BlockLinear]) -> dict:
    """Everything the answer depends on; a change in any of it measures again."""
    return {"version": PROBE_VERSION, **cpu_identity(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "limits": list(ROW_LIMITS), "prefill_rows": PREFILL_ROWS,
            "kernel": kernels.build_dir().name,  # keyed by the kernel's source
            "linears": [[lin.out_features, lin.in_features, lin.bits, lin.group, lin.isa, str(lin.weight.dtype)]
                        for lin in linears]}


def load_cached(key: dict) -> tuple[RowTimes, ...] | None:
    """The times kept for `key`; None when absent, corrupted or for another key."""
    stored = read_keyed(keyed_path("kernel_rows", key), key)
    try:
        times = tuple(RowTimes(**t) for t in stored["times"]) if stored is not None else None
    except (KeyError, TypeError):
        return None
    valid = times and all(isinstance(v, (int, float)) and v > 0 for t in times for v in (t.kernel_s, t.dense_s))
    return times if valid else None


def probe(layers: Sequence[Sequence[BlockLinear]]) -> KernelRows:
    """The row limit for a model whose layers have the GGUF linears `layers` (each layer's): from the disk cache, or
    measured on a sample of them (and then cached)."""
    linears = sampled(layers)
    key = probe_key(linears)
    times = load_cached(key)
    if times is not None:
        return chosen(times, from_cache=True)
    times = measure(linears)
    write_json_atomically(keyed_path("kernel_rows", key), {"key": key, "value": {"times": [asdict(t) for t in times]}},
                          "cache the kernel's row limit")
    return chosen(times, from_cache=False)
