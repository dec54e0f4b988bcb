"""The model a configuration names, resolved once: its path, device, dtype (and why), weights mode, cache
fingerprint, shape and KV pool layout, all from the model's metadata (never its weights).

`resolve_model(config)` is the one place these are decided. The engine builds its model (built_model.py) and its front
end from the result; a cluster's ingress builds its front end from it and gives its replicas the `[model]` section with
what was decided written in (`ResolvedModel.model_config`), so that they load the same weights in the same dtype, and
key their blocks alike, without probing again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreuse.config import Config, ModelConfig
from kvreuse.kvcache.layout import KVLayout, resolve_layout
from kvreuse.layers.kv_format import KVFormat, resolve_kv_format
from kvreuse.tuning import dtype_probe
from kvreuse.weights.gguf_weights import resolve_weights, weights_tag
from kvreuse.weights.loader import ModelArgs, ModelInfo, load_model_info
from kvreuse.weights.quantize import quantization_tag

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device = cuda, but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, args: ModelArgs) -> tuple[torch.dtype, str]:
    """The dtype of the weights and KV, and why (empty for an explicit `model.dtype`): `auto` is bf16 on CUDA
    and, on a CPU, whichever dtype the probe measured faster on `args`' prefill-shaped GEMMs (logged at INFO)."""
    if name != "auto":
        return DTYPES[name], ""
    if device.type == "cuda":
        return torch.bfloat16, "auto: cuda"
    result = dtype_probe.probe(args)
    logger.info("model.dtype = auto: %s on this CPU; %s", dtype_name(result.dtype), result.describe())
    return result.dtype, f"auto: {result.summary}"


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def kv_bytes_per_block(args: ModelArgs, layout: KVLayout, block_size: int, kv_format: KVFormat) -> int:
    """K and V of the layers one block holds (every layer, unless the layout groups them), scales included."""
    return layout.layers_per_block * 2 * block_size * args.num_kv_heads * kv_format.bytes_per_row(args.head_dim)


@dataclass(frozen=True)
class ResolvedModel:
    """What `resolve_model` decided about a `[model]` section (`given`, as configured)."""
    given: ModelConfig
    info: ModelInfo           # the model's shape, its path (a named model's file) and its files' sha256
    device: torch.device
    dtype: torch.dtype
    dtype_why: str            # why `model.dtype = auto` chose `dtype` (empty when it was given)
    weights: str              # `model.weights` as it applies here: "gguf" (the GGUF's own blocks) or "dense"
    # The cache fingerprint: the files' sha256, the dtype and the tags of what changes the numbers in the KV
    # (quantization, the GGUF kernel); tier entries and block keys carry it.
    fingerprint: str
    kv_layout: KVLayout       # the pool layout `cache.sliding_kv` asks for on this model
    kv_format: KVFormat       # how the pool holds K/V (`cache.kv_dtype`)
    # The longest context served: server.max_tokens within the model's context length (the RoPE tables' length).
    max_model_len: int | None = None

    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def args(self) -> ModelArgs:
        return self.info.args

    @property
    def dtype_description(self) -> str:
        """The dtype, and why where `auto` chose it: `fp32 (auto: ...)`; the ready and settings lines show it."""
        return f"{dtype_name(self.dtype)} ({self.dtype_why})" if self.dtype_why else dtype_name(self.dtype)

    @property
    def model_config(self) -> ModelConfig:
        """`given` with what was resolved written in (path, dtype, weights, the chat template's absolute path): it
        resolves to this model again, with no probe, from any working directory."""
        template = self.given.chat_template and str(Path(self.given.chat_template).resolve())
        return self.given.model_copy(update={"path": str(self.path), "dtype": dtype_name(self.dtype),
                                             "weights": self.weights, "chat_template": template})

    def config_of(self, config: Config) -> Config:
        """`config` (the one this model was resolved from) with `model_config` in place of its `[model]`."""
        return config.model_copy(update={"model": self.model_config})

    def kv_bytes_per_block(self, block_size: int) -> int:
        return kv_bytes_per_block(self.args, self.kv_layout, block_size, self.kv_format)


def resolve_model(config: Config) -> ResolvedModel:
    """`config`'s model resolved from its metadata: the device `model.device` names, `model.dtype = auto` decided
    (the probe, on a CPU), `model.weights`, the cache fingerprint and the KV layout. ModelLoadError for a bad model
    path, ConfigError for a layout the cache settings refuse, RuntimeError for a missing CUDA device."""
    model = config.model
    device = resolve_device(model.device)
    info = load_model_info(model.path or None)
    dtype, why = resolve_dtype(model.dtype, device, info.args)
    weights = resolve_weights(model.weights, model.quantization, info.path, device)
    kv_format = resolve_kv_format(config.cache.kv_dtype, dtype)
    # Cache keys must change whenever the numbers in the KV would: weights, dtype, quantization and a KV format other
    # than the model's dtype.
    tags = [quantization_tag(model.quantization), weights_tag(weights),
            f"kv-{kv_format.fingerprint_tag}" if kv_format.storage != dtype else ""]
    fingerprint = ":".join([info.fingerprint, str(dtype).removeprefix("torch."), *filter(None, tags)])
    return ResolvedModel(model, info, device, dtype, why, weights, fingerprint, resolve_layout(info.args, config.cache),
                         kv_format, min(config.server.max_tokens, info.args.max_position_embeddings))
