"""Weight-only quantization of the model's linear layers (``model.quantization = int8 | int4``).

Each decoder linear (qkv_proj, o_proj, gate_up_proj, down_proj) is replaced by a module that keeps its weight
quantized and multiplies with it directly; embed_tokens stays as it is. The LM head is quantized too (int8 in both
modes, see LM_HEAD): it is a fifth of the weights each decode step streams, and its int8 error is small.

- int8: per-output-channel symmetric scales, w = q * s with q in [-127, 127].
- int4: group-wise asymmetric (INT4_GROUP_SIZE consecutive inputs of one output share a scale and a zero),
  w = (q - 8) * s + z with q in [0, 15]: the convention of torch's int4 kernels.

How a product is computed, on a CPU (torch's `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`, measured in
torch 2.13 on an AVX512/AMX Xeon):
- Up to KERNEL_MAX_ROWS rows (decode): the quantized kernel, in bf16. The kernels take fp32 and fp16 too, but only
  their bf16 path is vectorized on x86 (at batch 1, fp32 activations ran 14x (int8) and 100x (int4) slower than
  bf16, and slower than the unquantized fp32 GEMM), so the activations are rounded to bf16 for the product,
  whatever the model dtype, and the result converted back.
- More rows (prefill): the kernels are then slower than a dense GEMM (~2x fp32's and ~9x bf16's at 512 rows), so
  the weight is dequantized to the activations' dtype and multiplied densely: prefill keeps the model dtype's
  speed, less the dequantization (5-10% of a 512-token fp32 prefill).
On any other device (CUDA): dequantize-then-matmul in the model dtype for every call. Correct and memory-saving,
but not faster: torch's CUDA int4 kernel (`_weight_int4pack_mm`, another packing) is not wired here.

Quantization is an approximation: it changes the numbers in the KV, so its tag (`quantization_tag`) must be part of
the model fingerprint and so of every cache key. How far it moves the output depends on where the weights come
from: the embedded SmolLM2's linears are Q4_1 (4 bits, a scale and a minimum per 32 inputs), already on int4's
grid, so int4 (group 32) gives them back almost exactly and int8 (one scale per row) is the lossier of the two
there; a bf16 checkpoint would lose more in int4 (the tiny random-weight test model: logit cosine 0.95-0.99).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # the front end imports quantization_tag: keep it from importing the model
    from kvreuse.model.decoder import CausalLM

logger = logging.getLogger(__name__)

MODES = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32
# The LM head's mode under each model mode: int8 in both. On the embedded model (fp32, 24 workload prompts, 32 greedy
# tokens) int4 linears with an int4 head gave mean first-token KL 0.036 and a greedy match of 11 tokens, with an int8
# head 0.0026 and 27, with an fp32 head 0.0008 and 29; batch-1 decode 55, 50 and 41 tok/s (fp32 unquantized: 20).
LM_HEAD = {"int8": "int8", "int4": "int8"}
DECODER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Rows up to which the quantized kernel beats dequantize + dense GEMM, measured on SmolLM2-135M's shapes (one thread,
# AMX Xeon): int8 breaks even at ~24 rows (bf16 model) to ~40 (fp32), int4 at ~64 (bf16) to ~100 (fp32).
KERNEL_MAX_ROWS = {"int8": 32, "int4": 64}
KERNEL_DTYPE = torch.bfloat16  # the dtype the CPU kernels vectorize
# int4 rows are padded to a multiple of this: every block of rows of torch's CPU packing is then full (blocks of 64
# rows with AVX512, 32 otherwise), so one unpacking rule holds, and the kernel's N % 16 requirement is met.
INT4_ROW_MULTIPLE = 64
# `_weight_int8pack_mm` returned garbage (or crashed) for K not a multiple of 16 in torch 2.13; we ask for 32.
INT8_KERNEL_K_MULTIPLE = 32


def quantization_tag(mode: str, *, group_size: int = INT4_GROUP_SIZE, lm_head: str | None = None) -> str:
    """The short name of a quantization scheme, for the model fingerprint: "" for none, "w8", "w4g32"; a head mode
    other than the mode's default (LM_HEAD) is appended: "w4g32.h4g32", "w8.hnone". Change it whenever the numbers a
    scheme produces change."""
    _check_mode(mode)
    if mode == "none":
        return ""
    head = LM_HEAD[mode] if lm_head is None else lm_head
    _check_mode(head)
    tag = _linear_tag(mode, group_size)
    return tag if head == LM_HEAD[mode] else f"{tag}.h{_linear_tag(head, group_size)[1:] or 'none'}"


def _linear_tag(mode: str, group_size: int) -> str:
    return {"none": "w", "int8": "w8", "int4": f"w4g{group_size}"}[mode]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; expected one of {', '.join(MODES)}")


@torch.no_grad()
def quantize_model(model: CausalLM, mode: str, *, group_size: int = INT4_GROUP_SIZE,
                   lm_head: str | None = None) -> None:
    """Replace `model`'s decoder linears (and its LM head, per `lm_head`, default LM_HEAD[mode]) in place with
    weight-only quantized modules on the same device. `mode="none"` leaves the model untouched. A model is
    quantized once (ValueError on a second call). A linear whose shape the scheme cannot take (in_features not a
    multiple of `group_size` for int4) is left unquantized, with a warning."""
    _check_mode(mode)
    if mode == "none":
        return
    head = LM_HEAD[mode] if lm_head is None else lm_head
    _check_mode(head)
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError("the model is already quantized")
    for i, layer in enumerate(model.layers):
        for name in DECODER_LINEARS:
            setattr(layer, name, quantize_linear(getattr(layer, name), mode, group_size, f"layers.{i}.{name}"))
    if head != "none":
        # A tied head shares embed_tokens' weight: the embedding keeps it, the head gets its own quantized copy.
        model.lm_head = quantize_linear(model.lm_head, head, group_size, "lm_head")


def quantize_linear(linear: nn.Linear, mode: str, group_size: int = INT4_GROUP_SIZE, name: str = "linear") -> nn.Module:
    """`linear` (bias-free) quantized in `mode` ("int8" or "int4"), or `linear` itself if its shape does not fit."""
    if linear.bias is not None:
        raise ValueError(f"{name}: only bias-free linears are quantized")
    weight = linear.weight.detach()                                      # [out, in]
    if mode == "int8":
        return Int8Linear(weight)
    if mode == "int4":
        if weight.shape[1] % group_size:
            logger.warning("%s: in_features %d is not a multiple of the int4 group size %d; left unquantized",
                           name, weight.shape[1], group_size)
            return linear
        return Int4Linear(weight, group_size)
    raise ValueError(f"cannot quantize a linear in mode {mode!r}")


class QuantizedLinear(nn.Module):
    """A bias-free linear whose weight is kept quantized. Input and output are in the model dtype; `dequantize`
    gives the weight the module multiplies by."""

    mode: str
    kernel_max_rows: int

    def __init__(self, weight: torch.Tensor, use_kernel: bool | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.model_dtype = weight.dtype
        # The CPU kernel (None: where torch has one), if the shape suits it (subclasses check).
        self.use_kernel = weight.device.type == "cpu" if use_kernel is None else use_kernel

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, "
                f"kernel={'cpu' if self.use_kernel else 'none (dequantize + matmul)'}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out], in x's dtype."""
        rows = x.reshape(-1, self.in_features)                           # [T, in]
        if self.use_kernel and rows.shape[0] <= self.kernel_max_rows:
            y = self._kernel(rows.to(KERNEL_DTYPE).contiguous()).to(x.dtype)  # [T, out]
        else:
            y = F.linear(rows, self.dequantize(x.dtype))                 # [T, out]
        return y.view(*x.shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] contiguous, KERNEL_DTYPE -> [T, out] KERNEL_DTYPE."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the module multiplies by: [out, in] in `dtype` (default: the model dtype)."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of the quantized weight and its scales (what a forward streams)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


class Int8Linear(QuantizedLinear):
    """int8 weight with one symmetric scale per output channel: w = q * s."""

    mode = "int8"
    kernel_max_rows = KERNEL_MAX_ROWS["int8"]

    def __init__(self, weight: torch.Tensor, use_kernel: bool | None = None):
        """weight: [out, in] in the model dtype; `use_kernel=False` always dequantizes (what non-CPU devices do)."""
        super().__init__(weight, use_kernel)
        w = weight.float()                                               # [out, in]
        # Scales are stored in the kernel's dtype and the codes computed against the stored (rounded) scales.
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(KERNEL_DTYPE)  # [out]
        q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)                 # [out, in]
        self.register_buffer("qweight", q)                               # [out, in] int8
        self.register_buffer("scales", scale)                            # [out] bf16
        self.use_kernel &= self.in_features % INT8_KERNEL_K_MULTIPLE == 0

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.model_dtype
        return self.qweight.to(dtype).mul_(self.scales.to(dtype)[:, None])  # [out, in]


class Int4Linear(QuantizedLinear):
    """4-bit weight, groups of `group_size` inputs with a scale and a zero each: w = (q - 8) * s + z.

    On a CPU the codes are kept in the packing of torch's `_convert_weight_to_int4pack_for_cpu` (machine-specific;
    `_cpu_int4_layout` learns how to read it back) with the output rows padded to INT4_ROW_MULTIPLE; elsewhere as
    two codes per byte, in order."""

    mode = "int4"
    kernel_max_rows = KERNEL_MAX_ROWS["int4"]

    def __init__(self, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE, use_kernel: bool | None = None):
        """weight: [out, in] in the model dtype, in a multiple of `group_size`; `use_kernel=False` keeps the codes
        in order and always dequantizes (what non-CPU devices do)."""
        super().__init__(weight, use_kernel)
        out, k = weight.shape
        self.group_size = group_size
        self.padded_out = -(-out // INT4_ROW_MULTIPLE) * INT4_ROW_MULTIPLE
        w = F.pad(weight.float(), (0, 0, 0, self.padded_out - out))      # [out', in], zero rows appended
        groups = w.view(self.padded_out, k // group_size, group_size)    # [out', G, group]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)             # [out', G]
        scale = ((high - low) / 15).to(KERNEL_DTYPE)                     # [out', G]
        # A constant group c: a scale of |c| / 8 makes the value of code 0 exactly c (and 1 where c = 0, padding).
        scale = torch.where(scale == 0, (low.abs() / 8).to(KERNEL_DTYPE), scale)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = (low + 8 * scale.float()).to(KERNEL_DTYPE)                # the value of code 8
        offset = zero.float() - 8 * scale.float()                        # the value of code 0, as stored
        q = torch.round((groups - offset[..., None]) / scale.float()[..., None]).clamp_(0, 15)
        codes = q.to(torch.int32).view(self.padded_out, k)               # [out', in] in [0, 15]
        # [G, out', 2] (scale, zero): the kernel's layout.
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous())
        self.register_buffer("qweight", self._pack(codes))

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [out', in] int32 -> the stored uint8 codes; settles `use_kernel`."""
        if self.use_kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)  # [out', in/2]
            # innerKTiles (1) only matters to the CUDA packing. Check that we read back what was packed.
            try:
                if torch.equal(_unpack_cpu(packed, *codes.shape).to(torch.int32), codes):
                    return packed
            except (RuntimeError, IndexError):  # a layout the probe could not read
                pass
            logger.warning("torch's CPU int4 packing is not the one expected: int4 runs without its kernel")
            self.use_kernel = False
        return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # [out', in/2]

    def codes(self) -> torch.Tensor:
        """The 4-bit codes, unpacked: [out', in] uint8 in [0, 15] (rows past out_features are padding)."""
        if self.use_kernel:
            return _unpack_cpu(self.qweight, self.padded_out, self.in_features)
        return torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1).view(self.padded_out, self.in_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, self.scales_and_zeros)
        return y if self.padded_out == self.out_features else y[:, :self.out_features].contiguous()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.model_dtype
        sz = self.scales_and_zeros.to(dtype)                             # [G, out', 2]
        scale = sz[..., 0].t()[..., None]                                # [out', G, 1]
        offset = (sz[..., 1] - 8 * sz[..., 0]).t()[..., None]            # [out', G, 1]: the value of code 0
        groups = self.codes().to(dtype).view(self.padded_out, -1, self.group_size)  # [out', G, group]
        w = groups.mul_(scale).add_(offset).view(self.padded_out, self.in_features)  # [out', in]
        return w[:self.out_features]


@functools.cache
def _cpu_int4_layout() -> tuple[int, torch.Tensor | None]:
    """How torch's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`) lays codes out on this machine, learned
    from a probe: (block_rows, gather). The packed [N, K/2] bytes, viewed as [N / block_rows, K, block_rows / 2],
    hold for each block of rows and each input k the low nibbles, then the high nibbles, of the block's rows in
    some order; `gather` [block_rows] picks them back into row order (None: already in order). torch 2.13 packs
    blocks of 64 rows (lanes 0|2, 1|3) with AVX512, 32 with AVX2, and pairs of rows elsewhere; the probe finds
    whichever it is, and every packed weight is checked against its codes (Int4Linear._pack)."""
    rows, k = INT4_ROW_MULTIPLE, 2
    row = torch.arange(rows, dtype=torch.int32)[:, None].expand(rows, k)
    col = torch.arange(k, dtype=torch.int32)[None, :].expand(rows, k)

    def nibbles(values: torch.Tensor) -> torch.Tensor:                  # [rows, k] -> [rows * k] in packed order
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.contiguous(), 1).flatten()
        return torch.stack([packed & 15, packed >> 4]).to(torch.int64)   # [2, rows * k / 2]: low, high

    digits = nibbles(row % 16) + 16 * nibbles(row // 16)                 # [2, bytes]: the row of each nibble
    block_bytes = int((nibbles(col)[0] == 1).nonzero()[0])               # bytes per (block, k)
    block_rows = 2 * block_bytes
    order = digits[:, :block_bytes].flatten()                            # [block_rows] rows of the first block, k=0
    identity = torch.arange(block_rows)
    return block_rows, None if torch.equal(order, identity) else torch.argsort(order)


def _unpack_cpu(packed: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Codes packed by `_convert_weight_to_int4pack_for_cpu` ([rows, k/2] uint8) -> [rows, k] uint8."""
    block_rows, gather = _cpu_int4_layout()
    b = packed.view(rows // block_rows, k, block_rows // 2).transpose(1, 2)  # [blocks, block_rows/2, k]
    codes = torch.cat([b & 15, b >> 4], dim=1)                           # [blocks, block_rows, k], packed order
    if gather is not None:
        codes = codes[:, gather]
    return codes.reshape(rows, k)


def weight_bytes(model: CausalLM) -> dict[str, int]:
    """Bytes of `model`'s weights: the decoder linears, the LM head, and everything (each tensor counted once, a
    tied head's weight with the embedding). The first two are what each decode step streams."""
    def size(module: nn.Module) -> int:
        if isinstance(module, QuantizedLinear):
            return module.weight_bytes()
        return sum(p.numel() * p.element_size() for p in module.parameters())

    linears = sum(size(getattr(layer, name)) for layer in model.layers for name in DECODER_LINEARS)
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return {"decoder_linears": linears, "lm_head": size(model.lm_head), "total": total}
