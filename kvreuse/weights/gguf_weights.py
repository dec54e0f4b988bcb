"""`model.weights = gguf`: the model's products read the GGUF file's own quantized blocks.

Each decoder linear and the LM head of a model loaded from a GGUF keep the file's blocks (gguf_blocks.py); the kernel
(kvreuse/kernels) dequantizes them in registers to exactly the dense weight's values and multiplies in fp32, at a
fifth (4-bit codes) to a third (8-bit) of the dense bytes, summing every row in one order whatever the row count.
- Where the kernel keeps up with the dense GEMM at a prefill's row count (measured per CPU: tuning/kernel_rows.py;
  an fp32 model on AVX-512), every product takes it (`GGUFLinear`), so a row's numbers never depend on what else is
  in its forward: prefix reuse gives the bits a cold run gives (docs/design/batch-invariance.md), and the model holds
  one copy of its weights, the blocks.
- Elsewhere (a bf16 model, whose GEMM runs in bf16; the AVX2 variant against MKL), prompt rows take the dense weight
  whatever their count, and generated rows (decode steps, the head's sampled rows) the kernel up to
  `kernel_max_rows` rows, the dense weight beyond (`SplitGGUFLinear`, routed by layers/row_kinds.py).
Where the kernel is not built or the CPU lacks AVX2 the dense weight is used: the same numbers as `dense`, so no tag.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.kernels import build as kernels
from kvreuse.layers import row_kinds
from kvreuse.model.decoder import FUSED_LINEARS, fused_parts
from kvreuse.tuning import kernel_rows
from kvreuse.weights.gguf_blocks import PANEL_ROWS, PackedBlocks, QuantizedBlocks, concat

if TYPE_CHECKING:
    from kvreuse.model.decoder import CausalLM
    from kvreuse.weights.loader import LoadedWeights


def resolve_weights(mode: str, quantization: str, path: Path, device: torch.device) -> str:
    """`model.weights` as it applies to the model at `path` (resolved) on `device`: "gguf" or "dense"."""
    if mode == "auto":
        return "gguf" if path.suffix == ".gguf" and quantization == "none" and device.type == "cpu" else "dense"
    if mode == "gguf" and device.type != "cpu":
        raise ValueError(f"model.weights = gguf runs on the CPU; model.device resolved to {device.type}")
    return mode


def weights_tag(mode: str) -> str:
    """The fingerprint tag of `mode` as resolved ("gguf" or "dense") on this machine: "" where its numbers are the
    dense path's, else the kernel's panel rows, its two sums per row and its variant ("gguf16s2.avx512"), which fix
    its summation order. Decided by torch's CPU capability, so that a front end that loads no kernel (a cluster's
    ingress) keys blocks alike."""
    if mode != "gguf":
        return ""
    isa = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability())
    return f"gguf{PANEL_ROWS}s2.{isa}" if isa else ""


class GGUFLinear(nn.Module):
    """A bias-free linear whose every product reads the GGUF blocks: one summation order per row for any row count."""

    def __init__(self, packed: PackedBlocks, in_features: int, source: str, isa: int):
        super().__init__()
        self.out_features, self.in_features = packed.out_features, in_features
        self.records = packed
        self.bits, self.group, self.half_scales = packed.bits, packed.group, packed.half_scales
        self.isa, self.source = isa, source
        self.register_buffer("packed", packed.data, persistent=False)   # uint8, the kernel's records

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.source} "
                f"({self.bits}-bit codes), kernel={kernels.ISAS.get(self.isa, 'none')}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out], in x's dtype."""
        rows = x.reshape(-1, self.in_features)                           # [T, in]
        return self.product(rows).view(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [T, in] -> [T, out]."""
        return self.kernel_product(rows)

    def kernel_product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [T, in] -> [T, out] from the blocks, multiplied in fp32 (rows' dtype in and out, cast in the op)."""
        return torch.ops.kvreuse_cpu.gguf_linear(rows.contiguous(), self.packed, self.out_features, self.bits,
                                                 self.group, self.half_scales, self.isa)


class SplitGGUFLinear(GGUFLinear):
    """A GGUF linear that also keeps the dense weight: prompt rows at the dense GEMM's speed, generated rows from the
    blocks up to `kernel_max_rows` of them. A prompt row's numbers do not depend on its step; a generated row's
    depend on how many generated rows its step holds, across `kernel_max_rows`."""

    # Where generated rows branch: one of kernel_rows.ROW_LIMITS, set by the probe (the compiled graphs split there);
    # more rows are compute-bound, where the dense GEMM's blocking wins.
    kernel_max_rows = kernel_rows.ROW_LIMITS[0]

    def __init__(self, weight: torch.Tensor, packed: PackedBlocks, source: str, isa: int):
        super().__init__(packed, weight.shape[1], source, isa)
        self.weight = weight                                             # [out, in], the model dtype

    def blocks_only(self) -> GGUFLinear:
        """The same linear without its dense weight: every row through the kernel."""
        return GGUFLinear(self.records, self.in_features, self.source, self.isa)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [T, in] -> [T, out], each row by its kind in the current forward (layers/row_kinds.py)."""
        return row_kinds.current().split(rows, self.prompt_product, self.generated_product)

    def generated_product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [T, in] -> [T, out]: the kernel's up to kernel_max_rows rows, else the dense weight's."""
        return self.kernel_product(rows) if rows.shape[0] <= self.kernel_max_rows else self.dense_product(rows)

    def prompt_product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [T, in] -> [T, out] from the dense weight. A single row goes in twice: GEMM libraries multiply one
        row another way (a GEMV), which summed a row of Gemma 3's down_proj in bf16 otherwise than a GEMM of any
        other row count (docs/design/batch-invariance.md)."""
        if rows.shape[0] == 1:
            return self.dense_product(rows.repeat(2, 1))[:1]
        return self.dense_product(rows)

    def dense_product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [T, in] -> [T, out] from the dense weight."""
        return F.linear(rows, self.weight)


def fused_blocks(weights: LoadedWeights) -> dict[str, QuantizedBlocks]:
    """The loaded blocks stacked as the model fuses its linears ("layers.0.qkv_proj", ..., "lm_head"), where every
    part has blocks of one code width."""
    blocks, fused = weights.blocks, {}
    for i in range(weights.args.num_layers):
        for name in FUSED_LINEARS:
            keys = fused_parts(blocks, f"layers.{i}.", name)
            if all(key in blocks for key in keys) and (stacked := concat([blocks[key] for key in keys])):
                fused[f"layers.{i}.{name}"] = stacked
    head = blocks.get("embed_tokens" if weights.args.tie_word_embeddings else "lm_head")
    if head is not None:
        fused["lm_head"] = head
    return fused


def use_gguf_blocks(model: CausalLM, weights: LoadedWeights) -> str:
    """Give `model`'s linears the GGUF blocks of `weights` (loaded with `keep_blocks`); a linear without blocks
    stays dense. On a device other than a CPU nothing changes. Returns a one-line summary."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        return f"dense (no GGUF kernel on {device.type})"
    status = kernels.load()
    if not status.isa:
        return f"dense ({status.reason})"
    blocks = fused_blocks(weights)
    targets = [(i, layer, name, f"layers.{i}.{name}") for i, layer in enumerate(model.layers)
               for name in FUSED_LINEARS]
    targets.append((None, model, "lm_head", "lm_head"))
    made: list[tuple[int | None, object, str, GGUFLinear]] = []  # (layer index or None for the head, owner, name)
    for i, owner, attr, key in targets:
        linear = getattr(owner, attr)
        if key in blocks and blocks[key].shape == tuple(linear.weight.shape):
            gguf = SplitGGUFLinear(linear.weight, blocks[key].pack(), blocks[key].source, status.isa)
            made.append((i, owner, attr, gguf))
    per_layer = [[lin for j, _, _, lin in made if j == i] for i in range(len(model.layers))]
    limit = ""
    if any(per_layer):
        rows = kernel_rows.probe([linears for linears in per_layer if linears])
        limit = f"; {rows.summary}"
        if rows.every_row:
            made = [(i, owner, attr, lin.blocks_only()) for i, owner, attr, lin in made]
        else:
            for _, _, _, lin in made:
                lin.kernel_max_rows = rows.limit
    for _, owner, attr, lin in made:
        setattr(owner, attr, lin)
    kinds = ", ".join(sorted({lin.source for *_, lin in made}))
    return f"gguf: {len(made)} of {len(targets)} linears read {kinds} blocks ({status.reason}){limit}"
