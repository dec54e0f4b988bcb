"""The resolved model (resolved_model.py) loaded onto its device: one function for the engine and for the process
that builds its compiled decode step (precompile.py), so that both make the same model."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvreuse.engine.heap import trim_heap
from kvreuse.engine.resolved_model import ResolvedModel
from kvreuse.kernels import build as kernels
from kvreuse.model.architectures import ARCHITECTURES
from kvreuse.model.decoder import CausalLM
from kvreuse.weights.errors import ModelLoadError
from kvreuse.weights.gguf_weights import use_gguf_blocks
from kvreuse.weights.loader import load_weights
from kvreuse.weights.quantize import quantize_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltModel:
    model: CausalLM
    weights_description: str  # what `model.weights` came to: "dense", or the GGUF kernel's rows and variant


def build_model(resolved: ResolvedModel) -> BuiltModel:
    """The weights at `resolved.path`, as `resolved` says (dtype, device, weights mode, quantization). ModelLoadError
    where they are not the model `resolved` read the metadata of (the files changed in between)."""
    built = _build(resolved)
    trim_heap()  # the loader's tensors, and the dense copies a GGUF model's linears dropped, leave the process
    return built


def _build(resolved: ResolvedModel) -> BuiltModel:
    config, mode = resolved.given, resolved.weights
    # The blocks are parsed only where the kernel runs; otherwise `gguf` is the dense path (use_gguf_blocks).
    weights = load_weights(resolved.path, keep_blocks=mode == "gguf" and kernels.load().isa > 0)
    if (weights.args, weights.fingerprint) != (resolved.args, resolved.info.fingerprint):
        raise ModelLoadError(f"{resolved.path} changed while it was loaded: its weights are not the model resolved")
    model = ARCHITECTURES[weights.args.architecture].model_class.from_weights(weights, resolved.dtype, resolved.device,
                                                                              resolved.max_model_len)
    quantize_model(model, config.quantization)  # weight-only; "none" leaves it as loaded
    description = use_gguf_blocks(model, weights) if mode == "gguf" else "dense"
    logger.info("model.weights = %s: %s", config.weights, description)
    return BuiltModel(model, description)
