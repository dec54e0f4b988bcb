"""Load a supported architecture's weights from a GGUF file or a Hugging Face directory into one naming scheme."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvreuse import embedded
from kvreuse.embedded import pin
from kvreuse.layers.rotary import ROPE_KINDS, Rope
from kvreuse.model.architectures import ARCHITECTURES, SUPPORTED, Architecture, by_gguf_name, by_hf_model_type
from kvreuse.model.args import ModelArgs
from kvreuse.weights import validate
from kvreuse.weights.errors import ModelLoadError
from kvreuse.weights.fingerprint import cached_sha256
from kvreuse.weights.gguf_blocks import QuantizedBlocks, from_gguf
from kvreuse.weights.gguf_metadata import GGUFFile, read_gguf
from kvreuse.weights.named_models import NAMED_MODELS, resolve_named_model

__all__ = ["LoadedWeights", "ModelArgs", "ModelInfo", "load_model_info", "load_weights"]



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


def embedded_model_path() -> Path:
    """The default model's GGUF, which kvreuse's build puts into the package (kvreuse/embedded/pin.py)."""
    path = Path(embedded.__file__).with_name(pin.FILE)
    if not path.is_file():
        raise ModelLoadError(
            f"the embedded model is missing from this install ({path}): kvreuse's build puts it there, so install "
            f"kvreuse again (`pip install .`, or `make run` in a clone), or pass --model PATH"
        )
    return path


def resolve_model_path(path: str | None) -> Path:
    """A model path, a model name (named_models.NAMED_MODELS: `gemma3-270m`), or None for the embedded model."""
    if not path:
        return embedded_model_path()
    resolved = Path(path).expanduser()
    if not resolved.exists() and (named := resolve_named_model(path)) is not None:
        return named
    if not resolved.exists():
        raise ModelLoadError(f"model path not found: {path} (expected a .gguf file, a Hugging Face directory or "
                             f"a model name: {', '.join(NAMED_MODELS)})")
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
        args, _ = _gguf_checked(read_gguf(resolved), resolved)  # the header and tensor table; no tensor data
        return ModelInfo(args, resolved, file_sha256([resolved]))
    files = _safetensors_files(resolved)
    args, _ = _hf_checked(resolved, _safetensors_shapes(files))
    return ModelInfo(args, resolved, _hf_fingerprint(resolved, files))


def _resolve_supported(path: str | Path | None) -> Path:
    resolved = resolve_model_path(str(path) if path else None)
    gguf = resolved.is_file() and resolved.suffix == ".gguf"
    if gguf or (resolved.is_dir() and (resolved / "config.json").is_file()):
        return resolved
    raise ModelLoadError(f"unsupported model path {resolved}: expected a .gguf file or a directory with config.json")


def file_sha256(paths: list[Path]) -> str:
    """A model's fingerprint: the sha256 of its files' bytes, remembered per file version (fingerprint.py)."""
    return cached_sha256(paths)


def _our_names(args: ModelArgs, present: set[str], top: tuple[str, str, str], layer_format: str,
               layer_names: dict[str, str]) -> dict[str, str]:
    """Our name -> the checkpoint's, for each of its tensors `present` that the model reads; `top` names its embedding,
    final norm and LM head (left out where the head is tied to the embedding), `layer_names` a layer's tensors by
    their name inside it. Which of them the model needs, it says itself (decoder.CausalLM.state_from)."""
    names = dict(zip(("embed_tokens", "norm", "lm_head"), top, strict=True))
    if args.tie_word_embeddings:
        del names["lm_head"]
    for i in range(args.num_layers):
        names.update({f"layers.{i}.{ours}": layer_format.format(i=i) + theirs for theirs, ours in layer_names.items()})
    return {ours: theirs for ours, theirs in names.items() if theirs in present}


def _check_all_used(path: Path, names: set[str], used: set[str], arch: Architecture) -> None:
    """A checkpoint tensor the model would not read is a variant we do not implement (an o_proj bias, say):
    refused, rather than silently computing something else."""
    unused = sorted(names - used)
    if unused:
        raise ModelLoadError(f"{path}: tensor(s) {', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''} are not "
                             f"part of kvreuse's {arch.name} architecture (an unsupported variant)")


def _rope(params: dict, where: str, prefix: str = "") -> Rope:
    """A rotary embedding from HF `rope_parameters` (or an old `rope_scaling` merged with `rope_theta`), its numbers
    checked (validate.py); `prefix` names where in config.json `params` are."""
    kind = params.get("rope_type", params.get("type")) or "default"
    real = lambda k: validate.positive(where, prefix + k, params.get(k))  # noqa: E731
    theta = real("rope_theta") if params.get("rope_theta") is not None else 10000.0
    if kind == "default":
        return Rope(theta)
    if kind == "linear":
        return Rope(theta, "linear", factor=real("factor"))
    if kind == "llama3":
        original = validate.integer(where, prefix + "original_max_position_embeddings",
                                    params.get("original_max_position_embeddings"), "original_max_position")
        return Rope(theta, "llama3", factor=real("factor"), low_freq_factor=real("low_freq_factor"),
                    high_freq_factor=real("high_freq_factor"), original_max_position=original)
    raise ModelLoadError(f"{where}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})")


# --- GGUF ------------------------------------------------------------------------------------------

def _gguf_field(fields, key: str, default=None):
    value = fields.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
        return default
    return value


def _unpermute_rope(out_features: int, num_heads: int) -> torch.Tensor:
    """The row order [out_features] that undoes llama.cpp's interleaving of each head's two rotary halves (GGUF
    "normal" RoPE), so that Q/K use the rotate-half layout of Hugging Face checkpoints: weight[order]."""
    return torch.arange(out_features).view(num_heads, out_features // num_heads // 2, 2).transpose(1, 2).reshape(-1)


GEMMA3_SLIDING_PATTERN = 6   # llama.cpp's: every sixth Gemma 3 layer is global
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _rope_freqs(file: GGUFFile) -> tuple[float, ...] | None:
    """A GGUF's `rope_freqs` (Llama 3's scaling, as per-frequency divisors), if it has one."""
    if "rope_freqs.weight" not in file.tensors:
        return None
    return tuple(float(x) for x in np.asarray(file.tensor_data("rope_freqs.weight"), dtype=np.float32).ravel())


def _gguf_args(fields, path: Path, shapes: dict[str, tuple], freq_factors: tuple[float, ...] | None) -> ModelArgs:
    """The model's shape from a GGUF's metadata, each value checked (validate.py) before it sizes anything; `shapes`
    maps tensor names to their (rows first) shapes."""
    name = _gguf_field(fields, "general.architecture")
    arch = by_gguf_name(name)
    if arch is None:
        raise ModelLoadError(f"{path}: architecture {name!r} is not supported (supported: {SUPPORTED})")
    key = lambda k, default=None: _gguf_field(fields, f"{name}.{k}", default)  # noqa: E731
    num = lambda k, field, default=None: validate.integer(path, f"{name}.{k}", key(k, default), field)  # noqa: E731
    num_heads, hidden_size = num("attention.head_count", "num_heads"), num("embedding_length", "hidden_size")
    num_layers = num("block_count", "num_layers")
    if "token_embd.weight" not in shapes:
        raise ModelLoadError(f"{path}: the file has no tensor token_embd.weight (allowed: a file with every tensor "
                             f"of the architecture)")
    vocab_size = validate.integer(path, "token_embd.weight rows", shapes["token_embd.weight"][0], "vocab_size")
    head_dim = num("attention.key_length", "head_dim",
                   validate.head_dim_of(path, f"{name}.attention.head_count", hidden_size, num_heads))
    rope_dims = num("rope.dimension_count", "head_dim", head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(f"{path}: partial rotary ({name}.rope.dimension_count = {rope_dims} of a head's "
                             f"{head_dim}) is not supported: RoPE over the whole head only")
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > vocab_size:
        raise ModelLoadError(f"{path}: tokenizer.ggml.tokens has {len(tokens)} tokens, more than the embedding's "
                             f"{vocab_size} rows (token_embd.weight; allowed: at most {vocab_size})")
    args = ModelArgs(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=num("feed_forward_length", "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num("attention.head_count_kv", "num_kv_heads", num_heads),
        head_dim=head_dim,
        rope=_gguf_rope(name, key, path, shapes, freq_factors),
        rms_norm_eps=validate.positive(path, f"{name}.attention.layer_norm_rms_epsilon",
                                       key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=num("context_length", "max_position_embeddings"),
        tie_word_embeddings="output.weight" not in shapes,
        architecture=arch.name,
        attention_bias="blk.0.attn_q.bias" in shapes,
        qk_norm="blk.0.attn_q_norm.weight" in shapes,
        final_logit_softcapping=_gguf_softcap(name, key, path),
        **_gguf_sliding(arch, name, key, num, num_layers, head_dim),
    )
    validate.check_args(args, path, _gguf_keys(name))
    return args


def _gguf_keys(name: str) -> dict[str, str]:
    """Each ModelArgs field's key in a GGUF of architecture `name`, for messages."""
    keys = {"num_heads": "attention.head_count", "num_kv_heads": "attention.head_count_kv",
            "head_dim": "attention.key_length", "num_layers": "block_count", "hidden_size": "embedding_length"}
    return {**{field: f"{name}.{k}" for field, k in keys.items()}, "vocab_size": "token_embd.weight rows"}


def _gguf_rope(name: str, key, path: Path, shapes: dict, freq_factors: tuple[float, ...] | None) -> Rope:
    scaling = str(key("rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported (supported: none, linear)")
    if "rope_factors_long.weight" in shapes:  # the converter's LongRoPE (Phi-3 128k, Phi-3.5)
        raise ModelLoadError(f"{path}: rope type 'longrope' is not supported (supported: {', '.join(ROPE_KINDS)})")
    real = lambda k, default: validate.positive(path, f"{name}.{k}", key(k, default))  # noqa: E731
    return Rope(real("rope.freq_base", 10000.0), "linear" if scaling == "linear" else "default",
                factor=real("rope.scaling.factor", 1.0), freq_factors=freq_factors)


def _gguf_softcap(name: str, key, path: Path) -> float | None:
    softcap = key("final_logit_softcapping", 0.0)
    return validate.positive(path, f"{name}.final_logit_softcapping", softcap) if softcap else None


def _gguf_sliding(arch: Architecture, name: str, key, num, num_layers: int, head_dim: int) -> dict:
    """The layer kinds and window of a GGUF (`num`: a checked integer by its key and ModelArgs field)."""
    if arch.name == "gemma3":
        pattern = num("attention.sliding_window_pattern", "sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        return dict(layer_kinds=tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)),
                    sliding_window=num("attention.sliding_window", "sliding_window"),
                    sliding_rope=Rope(GEMMA3_LOCAL_ROPE_THETA), query_pre_attn_scalar=float(head_dim))
    if key("attention.sliding_window", 0) == 0:  # 0: none
        return {}
    # No layer pattern: every layer windowed, as an HF config's `sliding_window` alone means (Phi-3's; llama.cpp itself
    # ignores a Phi-3 window).
    return dict(layer_kinds=("sliding",) * num_layers, sliding_window=num("attention.sliding_window", "sliding_window"))


def _gguf_checked(file: GGUFFile, path: Path) -> tuple[ModelArgs, dict[str, str]]:
    """A GGUF's args and our names of its tensors, its metadata and its tensors' shapes checked (validate.py)."""
    shapes = {name: t.shape for name, t in file.tensors.items()}
    args = _gguf_args(file.fields, path, shapes, _rope_freqs(file))
    arch = _architecture(args)
    top = ("token_embd.weight", "output_norm.weight", "output.weight")
    names = _our_names(args, set(shapes), top, "blk.{i}.", arch.gguf_layer_names)
    validate.check_tensors(args, path, _gguf_keys(str(file.fields["general.architecture"])),
                           shapes, names, arch.gguf_layer_names)
    return args, names


def _load_gguf(path: Path, keep_blocks: bool = False) -> LoadedWeights:
    from gguf.quants import dequantize

    file = read_gguf(path)
    args, names = _gguf_checked(file, path)
    _check_all_used(path, set(file.tensors), {*names.values(), "rope_freqs.weight"}, _architecture(args))
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantizedBlocks] = {}
    for name, info in file.tensors.items():
        data = file.tensor_data(name)
        # The types the kernel reads are dequantized from their blocks (the same values bit for bit as gguf-py's,
        # tests/test_gguf_kernel.py, in torch's threads rather than numpy's one); the others by gguf-py.
        quantized = from_gguf(data, info.ggml_type)
        if quantized is not None:
            tensors[name] = quantized.dequantize()
            if keep_blocks:
                blocks[name] = quantized
            continue
        try:
            array = dequantize(data, info.ggml_type)
        except NotImplementedError as exc:
            raise ModelLoadError(f"{path}: tensor {name} has type {info.ggml_type.name}, which the GGUF "
                                 f"reader cannot dequantize ({exc})") from exc
        tensors[name] = torch.from_numpy(np.array(array, dtype=np.float32))
    arch = _architecture(args)
    ours = {name: tensors[theirs] for name, theirs in names.items()}
    our_blocks = {name: blocks[theirs] for name, theirs in names.items() if theirs in blocks}
    if arch.gguf_permuted_qk:
        for i in range(args.num_layers):
            for name, heads in ((f"layers.{i}.q_proj", args.num_heads), (f"layers.{i}.k_proj", args.num_kv_heads)):
                order = _unpermute_rope(ours[name].shape[0], heads)
                ours[name] = ours[name][order]
                if name in our_blocks:
                    our_blocks[name] = our_blocks[name].rows(order)
    return LoadedWeights(args, ours, path, file_sha256([path]), our_blocks)


def _architecture(args: ModelArgs) -> Architecture:
    return ARCHITECTURES[args.architecture]


# --- Hugging Face directory -------------------------------------------------------------------------

def _hf_config(path: Path):
    """The directory's architecture and its transformers config (which reads every older spelling of its fields);
    ModelLoadError naming config.json where it is no JSON object or transformers refuses it."""
    from transformers import AutoConfig

    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
        model_type = raw.get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        raise ModelLoadError(f"{file}: expected a JSON object ({type(exc).__name__}: {exc})") from None
    arch = by_hf_model_type(model_type)
    if arch is None:
        hint = " (multimodal: only the text model, gemma3_text, is supported)" if model_type == "gemma3" else ""
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not supported{hint} (supported: {SUPPORTED})")
    # The shape's numbers as written, before transformers derives anything from them (a head dim from 0 heads).
    for name, key in HF_KEYS.items():
        if raw.get(key) is not None:
            validate.integer(file, key, raw[key], name)
    for key in ("rms_norm_eps", "rope_theta"):
        if raw.get(key) is not None:
            validate.positive(file, key, raw[key])
    try:
        return arch, AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 (any refusal of a hostile config, transformers' strict fields among them)
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ModelLoadError(f"{file}: transformers cannot read it ({reason})") from None


def _safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from the files' headers (no tensor data is read); ModelLoadError naming a file that is
    no safetensors file (a truncated one)."""
    from safetensors import SafetensorError, safe_open

    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    return {name: shape for name, shape in shapes.items() if not name.endswith("rotary_emb.inv_freq")}


def _safetensors_files(path: Path) -> list[Path]:
    """The directory's weight files: those its `model.safetensors.index.json` names, or else its *.safetensors; each
    a regular file inside the directory once links are followed (`_shard_roots`), so that a downloaded index or link
    cannot make the loader open another file, a FIFO or a device."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors files")
        return [_checked_shard(path, file.name, f"{path}: shard") for file in files]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ModelLoadError(f"{index}: expected a JSON object with a weight_map of tensor names to shard file "
                             f"names ({type(exc).__name__}: {exc})") from None
    return [_checked_shard(path, name, f"{index}: shard") for name in names]


def _checked_shard(path: Path, name, where: str) -> Path:
    if not isinstance(name, str) or not name:
        raise ModelLoadError(f"{where} {name!r} is not a file name")
    file = path / name  # kept as named: the fingerprint hashes the files in this path order
    try:
        target = file.resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a link loop
        raise ModelLoadError(f"{where} {name!r} is not a file name ({exc})") from None
    if not any(target.is_relative_to(root) for root in _shard_roots(path)):
        raise ModelLoadError(f"{where} {name!r} resolves to {target}, outside the model directory {path.resolve()}")
    if not target.is_file():
        why = "does not exist" if not target.exists() else "is not a regular file"
        raise ModelLoadError(f"{where} {name!r} {why} ({target})")
    return file


def _shard_roots(path: Path) -> tuple[Path, ...]:
    """Where a directory's weight files may lie once links are followed: inside it, and for a Hugging Face hub cache
    snapshot (models--org--name/snapshots/REVISION, whose files link to ../../blobs), in that repository's blobs."""
    root = path.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return root, root.parent.parent / "blobs"
    return (root,)


def _hf_fingerprint(path: Path, files: list[Path]) -> str:
    """The weights' bytes and the config's: two directories with one checkpoint and different settings (a rope
    scaling, a window) compute different K/V, so they must key their blocks apart."""
    return file_sha256([*files, path / "config.json"])


HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
           "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
           "max_position_embeddings": "max_position_embeddings"}


def _hf_numbers(config, where: Path) -> dict:
    """The shape's integers from a transformers config, each checked (validate.py), the head dimension derived from
    the hidden size where the config names none."""
    num = lambda field, default=None: validate.integer(  # noqa: E731
        where, HF_KEYS[field], _hf_value(config, HF_KEYS[field], default), field)
    numbers = {field: num(field) for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                               "num_heads")}
    numbers["num_kv_heads"] = num("num_kv_heads", numbers["num_heads"])
    numbers["max_position_embeddings"] = num("max_position_embeddings", 4096)
    derived = None if _hf_value(config, "head_dim") is not None else validate.head_dim_of(
        where, "num_attention_heads", numbers["hidden_size"], numbers["num_heads"])
    numbers["head_dim"] = num("head_dim", derived)
    return numbers


def _hf_value(config, key: str, default=None):
    """A config's value, `default` where it is absent or null (as transformers' defaults are)."""
    value = getattr(config, key, None)
    return default if value is None else value


def _hf_rope(config, where: Path) -> tuple[Rope, Rope | None]:
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params:  # one rotary per layer type (Gemma 3)
        return (_rope(params["full_attention"], str(where), "rope_parameters.full_attention."),
                _rope(params["sliding_attention"], str(where), "rope_parameters.sliding_attention."))
    return _rope({"rope_theta": getattr(config, "rope_theta", None), **params}, str(where), "rope_parameters."), None


def _hf_sliding(config, where: Path, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """The layer kinds and the window (a checked positive integer where any layer slides)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
        if unknown := set(types) - {"sliding_attention", "full_attention"}:
            raise ModelLoadError(f"{where}: layer type(s) {sorted(unknown)} are not supported")
        if len(kinds) != num_layers:
            raise ModelLoadError(f"{where}: layer_types has {len(kinds)} entries (allowed: num_hidden_layers = "
                                 f"{num_layers})")
    else:
        kinds = ("sliding",) * num_layers if window else ()
    if "sliding" not in kinds:
        return (), None
    return kinds, validate.integer(where, "sliding_window", window, "sliding_window")


def _hf_args(arch: Architecture, config, tensor_names: set[str], path: Path) -> ModelArgs:
    """The model's shape from its transformers config and the names of its checkpoint's tensors, each value checked
    (validate.py) before it sizes anything."""
    where = Path(path) / "config.json"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act != arch.hidden_act:
        raise ModelLoadError(f"{path}: activation {act!r} is not supported for {arch.name} "
                             f"(expected {arch.hidden_act})")
    if getattr(config, "attn_logit_softcapping", None):
        raise ModelLoadError(f"{path}: attn_logit_softcapping is not supported")
    params = getattr(config, "rope_parameters", None) or {}
    rotary_fraction = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if rotary_fraction not in (None, 1.0):
        raise ModelLoadError(f"{path}: partial_rotary_factor = {rotary_fraction} is not supported "
                             f"(only 1.0: RoPE over the whole head)")
    numbers = _hf_numbers(config, where)
    rope, sliding_rope = _hf_rope(config, where)
    kinds, window = _hf_sliding(config, where, numbers["num_layers"])
    optional = lambda key: None if getattr(config, key, None) is None else validate.positive(  # noqa: E731
        where, key, getattr(config, key))
    args = ModelArgs(
        **numbers,
        rope=rope,
        rms_norm_eps=validate.positive(where, "rms_norm_eps", _hf_value(config, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)) or "lm_head.weight" not in tensor_names,
        architecture=arch.name,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensor_names,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in tensor_names,
        layer_kinds=kinds,
        sliding_window=window,
        sliding_rope=sliding_rope,
        query_pre_attn_scalar=optional("query_pre_attn_scalar"),
        final_logit_softcapping=optional("final_logit_softcapping"),
    )
    validate.check_args(args, where, HF_KEYS)
    return args


def _hf_checked(path: Path, shapes: dict[str, tuple[int, ...]]) -> tuple[ModelArgs, dict[str, str]]:
    """An HF directory's args and our names of its tensors, its config and its tensors' shapes checked."""
    arch, config = _hf_config(path)
    args = _hf_args(arch, config, set(shapes), path)
    top = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    names = _our_names(args, set(shapes), top, "model.layers.{i}.", arch.hf_layer_names)
    validate.check_tensors(args, path, HF_KEYS, shapes, names, arch.hf_layer_names)
    _check_all_used(path, set(shapes) - ({"lm_head.weight"} if args.tie_word_embeddings else set()),
                    set(names.values()), arch)
    return args, names


def _load_hf_dir(path: Path) -> LoadedWeights:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = _safetensors_files(path)
    args, names = _hf_checked(path, _safetensors_shapes(files))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update({k: v.float() for k, v in load_file(str(file)).items()})
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    ours = {name: tensors[theirs] for name, theirs in names.items()}
    if (offset := _architecture(args).hf_norm_offset):
        ours = {k: v + offset if k.endswith("norm") else v for k, v in ours.items()}
    return LoadedWeights(args, ours, path, _hf_fingerprint(path, files))
