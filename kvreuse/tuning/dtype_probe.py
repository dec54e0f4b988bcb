"""`model.dtype = auto` on a CPU: time the model's own GEMMs in fp32 and bf16 once per machine and keep the
answer on disk. Whether bf16 pays depends on the CPU (AMX or avx512_bf16: several times faster; AVX2 only:
several times slower), so it is measured, not guessed."""

from __future__ import annotations

import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from kvreuse.cache_dir import keyed_path, read_keyed, write_json_atomically

logger = logging.getLogger(__name__)


class LayerShape(Protocol):
    """What the probe reads of a model's shape (model/args.py's `ModelArgs` has it): tuning/ sits below the model and
    measures what it is handed."""
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

# Bumped whenever what is measured changes, so that answers measured the old way are not reused.
PROBE_VERSION = 1
PREFILL_TOKENS = 512
# Large models get fewer prefill tokens, so the probe stays within a few hundred ms; a GEMM of 64+ rows is
# still compute-bound, which is what the prefill figure is about.
PREFILL_FLOP_CAP = 4e9
MIN_PREFILL_TOKENS = 64
REPEATS = 5
# A busy machine (another process on our cores) can make every sample ten times slower: past this, stop at the
# median of MIN_REPEATS rather than hold up the load.
PROBE_BUDGET_S = 0.5
MIN_REPEATS = 3
DECODE_INNER = 8  # batch-1 GEMVs take microseconds: several per sample so that timer noise does not decide
# Workloads here are prefill-bound, so the prefill figure decides; bf16 must win it clearly, because fp32 is the
# more exact of the two and a few hundred ms of timing carry some noise.
BF16_MIN_SPEEDUP = 1.2
# The flags that decide how fast a bf16 or fp32 GEMM can run on x86 (others are irrelevant to the answer).
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


@dataclass(frozen=True)
class Figures:
    """Seconds (medians) for one pass over a decoder layer's linears, in each dtype, prefill- and batch-1-shaped."""
    prefill_tokens: int
    fp32_prefill_s: float
    bf16_prefill_s: float
    fp32_decode_s: float
    bf16_decode_s: float
    probe_s: float  # how long measuring took (all of it, warm-up included)


@dataclass(frozen=True)
class ProbeResult:
    figures: Figures
    flops_per_token: float
    cache_path: Path | None  # where the answer is kept; None if it could not be written
    from_cache: bool

    @property
    def prefill_speedup(self) -> float:
        """How many times faster bf16 ran the prefill-shaped GEMMs than fp32."""
        return self.figures.fp32_prefill_s / self.figures.bf16_prefill_s

    @property
    def decode_speedup(self) -> float:
        return self.figures.fp32_decode_s / self.figures.bf16_decode_s

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.prefill_speedup >= BF16_MIN_SPEEDUP else torch.float32

    @property
    def summary(self) -> str:
        """The short form, for the ready line: `bf16 3.1x fp32 on prefill GEMMs`."""
        return f"bf16 {self.prefill_speedup:.1f}x fp32 on prefill GEMMs"

    @property
    def reason(self) -> str:
        """Why `dtype` follows from the figures: the rule, and the prefill figure it was applied to."""
        verdict = "bf16" if self.dtype == torch.bfloat16 else "fp32"
        return (f"{verdict}, because bf16 is taken only where it runs the prefill GEMMs at least {BF16_MIN_SPEEDUP}x "
                f"as fast as fp32 (the more exact dtype), and here it {_pace(self.prefill_speedup)}; the GEMV figure "
                f"does not count, since the workloads kvreuse serves are prefill-bound")

    def describe(self) -> str:
        """Every figure and the reason, for the log."""
        f = self.figures
        prefill_flops = self.flops_per_token * f.prefill_tokens
        source = f"cached in {self.cache_path}" if self.from_cache else f"measured in {f.probe_s * 1000:.0f} ms"
        return (f"prefill GEMMs ({f.prefill_tokens} tokens): fp32 {f.fp32_prefill_s * 1e3:.2f} ms "
                f"({prefill_flops / f.fp32_prefill_s / 1e9:.0f} GFLOP/s), bf16 {f.bf16_prefill_s * 1e3:.2f} ms "
                f"({prefill_flops / f.bf16_prefill_s / 1e9:.0f} GFLOP/s): bf16 {_pace(self.prefill_speedup)}; "
                f"batch-1 GEMVs (a decode step's shape): fp32 {f.fp32_decode_s * 1e6:.0f} us, "
                f"bf16 {f.bf16_decode_s * 1e6:.0f} us: bf16 {_pace(self.decode_speedup)}; {self.reason}; {source}")


def _pace(speedup: float) -> str:
    """How bf16 ran against fp32, given fp32's time over bf16's: "ran 3.10x as fast" or "took 25.0x as long"."""
    return f"ran {speedup:.2f}x as fast" if speedup >= 1 else f"took {1 / speedup:.1f}x as long"


def layer_shapes(args: LayerShape) -> list[tuple[int, int]]:
    """(in, out) of a decoder layer's linears, fused as `Llama` fuses them: qkv, o, gate_up, down."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return [(args.hidden_size, q + 2 * kv), (q, args.hidden_size),
            (args.hidden_size, 2 * args.intermediate_size), (args.intermediate_size, args.hidden_size)]


def flops_per_token(shapes: list[tuple[int, int]]) -> float:
    return float(sum(2 * i * o for i, o in shapes))


def prefill_tokens(shapes: list[tuple[int, int]]) -> int:
    fitting = int(PREFILL_FLOP_CAP / flops_per_token(shapes)) // MIN_PREFILL_TOKENS * MIN_PREFILL_TOKENS
    return max(MIN_PREFILL_TOKENS, min(PREFILL_TOKENS, fitting))


def measure(shapes: list[tuple[int, int]], tokens: int) -> Figures:
    """Time the layer's linears in fp32 and bf16, prefill-shaped (`tokens` rows) and batch 1: one warm-up, then
    the median of REPEATS samples (MIN_REPEATS past PROBE_BUDGET_S), the dtypes interleaved (alternating which goes
    first) so that drift cancels."""
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    weights32 = [torch.randn(o, i, generator=g) * i ** -0.5 for i, o in shapes]
    weights = {torch.float32: weights32, torch.bfloat16: [w.to(torch.bfloat16) for w in weights32]}
    # One contiguous input per width, as the model's activations are (a sliced view could cost a copy).
    inputs32 = {(rows, i): torch.randn(rows, i, generator=g) for rows in (tokens, 1) for i, _ in shapes}
    inputs = {(dtype, *k): x.to(dtype) for dtype in weights for k, x in inputs32.items()}

    def one_pass(dtype: torch.dtype, rows: int, times: int) -> float:
        pairs = [(inputs[dtype, rows, w.shape[1]], w) for w in weights[dtype]]
        t0 = time.perf_counter()
        for _ in range(times):
            for x, w in pairs:
                F.linear(x, w)
        return (time.perf_counter() - t0) / times

    kinds = [(torch.float32, tokens, 1), (torch.bfloat16, tokens, 1),
             (torch.float32, 1, DECODE_INNER), (torch.bfloat16, 1, DECODE_INNER)]
    samples: dict[tuple, list[float]] = {kind: [] for kind in kinds}
    for kind in kinds:
        one_pass(*kind)  # warm-up: first-call allocation, kernel selection, weight prepacking
    for repeat in range(REPEATS):
        if repeat >= MIN_REPEATS and time.perf_counter() - start > PROBE_BUDGET_S:
            break
        for kind in (kinds if repeat % 2 == 0 else kinds[::-1]):
            samples[kind].append(one_pass(*kind))
    fp32_prefill, bf16_prefill, fp32_decode, bf16_decode = (statistics.median(samples[k]) for k in kinds)
    return Figures(tokens, fp32_prefill, bf16_prefill, fp32_decode, bf16_decode, time.perf_counter() - start)


def cpu_identity() -> dict:
    """What decides a CPU's GEMM speed per dtype: its model string and its bf16-relevant flags."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass  # not Linux: the model string from platform stands alone
    return {"cpu": model, "machine": platform.machine(), "flags": sorted(flags.intersection(RELEVANT_FLAGS))}


def probe_key(shapes: list[tuple[int, int]]) -> dict:
    """Everything the answer depends on; a change in any of it measures again."""
    return {"version": PROBE_VERSION, **cpu_identity(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "shapes": [list(s) for s in shapes]}


def load_cached(path: Path, key: dict) -> Figures | None:
    """The figures kept at `path` for `key`; None when absent, unreadable, corrupted or for another key."""
    stored = read_keyed(path, key)
    if stored is None:
        return None
    try:
        figures = Figures(**stored)
    except TypeError as exc:
        logger.info("ignoring the dtype probe cache %s (it is measured again): %s", path, exc)
        return None
    values = [getattr(figures, name) for name in ("fp32_prefill_s", "bf16_prefill_s", "fp32_decode_s",
                                                  "bf16_decode_s")]
    return figures if all(isinstance(v, (int, float)) and v > 0 for v in values) else None


def store(path: Path, key: dict, figures: Figures) -> bool:
    """Write the answer atomically (write_json_atomically); False, and logged, when it cannot be written."""
    return write_json_atomically(path, {"key": key, "value": asdict(figures)}, "cache the dtype probe")


def probe(args: LayerShape) -> ProbeResult:
    """fp32 against bf16 on this CPU for `args`' shapes: from the disk cache, or measured (and then cached)."""
    shapes = layer_shapes(args)
    key = probe_key(shapes)
    path = keyed_path("dtype_probe", key)
    figures = load_cached(path, key)
    if figures is not None:
        return ProbeResult(figures, flops_per_token(shapes), path, from_cache=True)
    figures = measure(shapes, prefill_tokens(shapes))
    stored = store(path, key, figures)
    return ProbeResult(figures, flops_per_token(shapes), path if stored else None, from_cache=False)
