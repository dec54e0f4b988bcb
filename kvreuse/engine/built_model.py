"""The model a `[model]` section names, loaded onto a device: one function for the engine and for the process that
builds its compiled decode step (precompile.py), so that both make the same model."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvreuse.config import ModelConfig
from kvreuse.engine.front_end import dtype_name, resolve_dtype
from kvreuse.kernels import build as kernels
from kvreuse.model.architectures import ARCHITECTURES
from kvreuse.model.decoder import CausalLM
from kvreuse.model.gguf_weights import resolve_weights, use_gguf_blocks
from kvreuse.model.loader import ModelInfo, load_weights, resolve_model_path
from kvreuse.model.quantize import quantize_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltModel:
    model: CausalLM
    info: ModelInfo
    dtype: torch.dtype
    dtype_why: str            # why `model.dtype = auto` chose `dtype` (empty when it was given)
    weights_mode: str         # "gguf" (the GGUF's own blocks) or "dense"
    weights_description: str

    def resolved(self, config: ModelConfig) -> ModelConfig:
        """`config` with what was resolved written in (path, dtype, weights): it builds this model again."""
        return config.model_copy(update={"path": str(self.info.path), "dtype": dtype_name(self.dtype),
                                         "weights": self.weights_mode})


def build_model(config: ModelConfig, device: torch.device) -> BuiltModel:
    path = resolve_model_path(config.path or None)
    mode = resolve_weights(config.weights, config.quantization, path, device)
    # The blocks are parsed only where the kernel runs; otherwise `gguf` is the dense path (use_gguf_blocks).
    weights = load_weights(path, keep_blocks=mode == "gguf" and kernels.load().isa > 0)
    dtype, why = resolve_dtype(config.dtype, device, weights.args)
    model = ARCHITECTURES[weights.args.architecture].model_class.from_weights(weights, dtype, device)
    quantize_model(model, config.quantization)  # weight-only; "none" leaves it as loaded
    description = use_gguf_blocks(model, weights) if mode == "gguf" else "dense"
    logger.info("model.weights = %s: %s", config.weights, description)
    return BuiltModel(model, ModelInfo(weights.args, weights.path, weights.fingerprint), dtype, why, mode, description)
