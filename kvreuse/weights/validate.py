"""One check of a model's metadata, GGUF and Hugging Face alike, before anything is sized by it: each number read
from the file is checked where it is read (`integer`, `positive`), and the whole (`check_args`) and the tensors'
shapes (`check_tensors`) before any weight is copied. Every failure is one ModelLoadError naming the file, the key
and the values allowed, so that a hostile file (heads of 0, a context of 10^9, a NaN epsilon, a tensor of the wrong
shape) is refused in one line rather than by a traceback, a huge allocation or garbage output."""

from __future__ import annotations

import math
import re

import numpy as np

from kvreuse.model.args import ModelArgs
from kvreuse.weights.errors import ModelLoadError

# The largest value allowed for each integer of a model's shape (the largest models served today use a tenth or less).
BOUNDS = {
    "vocab_size": 2**22,
    "hidden_size": 2**17,
    "intermediate_size": 2**19,
    "num_layers": 1024,
    "num_heads": 1024,
    "num_kv_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 2**24,
    "sliding_window": 2**24,
    "sliding_window_pattern": 1024,
    "original_max_position": 2**24,
}


def integer(where, key: str, value, field: str) -> int:
    """`value`, read from `key`, as an int from 1 to BOUNDS[field]; an integral float (JSON's 4096.0) is taken."""
    whole = isinstance(value, int | np.integer) or isinstance(value, float | np.floating) and float(value).is_integer()
    if isinstance(value, bool) or not whole or not 1 <= int(value) <= BOUNDS[field]:
        raise ModelLoadError(f"{where}: {key} = {value!r} is not allowed (allowed: an integer from 1 to "
                             f"{BOUNDS[field]})")
    return int(value)


def positive(where, key: str, value) -> float:
    """`value`, read from `key`, as a finite float above 0 (a rope base or factor, a norm epsilon)."""
    number = float(value) if isinstance(value, int | float | np.integer | np.floating) else math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
        raise ModelLoadError(f"{where}: {key} = {value!r} is not allowed (allowed: a finite number above 0)")
    return number


def head_dim_of(where, heads_key: str, hidden_size: int, num_heads: int) -> int:
    """A head's width where the file names none: the hidden size split evenly among the query heads."""
    if hidden_size % num_heads:
        raise ModelLoadError(f"{where}: {heads_key} = {num_heads} does not divide the hidden size {hidden_size} "
                             f"(allowed: a divisor of it, where the file names no head dimension)")
    return hidden_size // num_heads


def check_tokenizer(where, num_tokens: int, vocab_size: int) -> None:
    """A tokenizer of `num_tokens` tokens (added ones included) must fit the embedding's `vocab_size` rows: a larger
    one encodes ids the model has no row for."""
    if num_tokens > vocab_size:
        raise ModelLoadError(f"{where}: the tokenizer has {num_tokens} tokens, more than the model's vocab_size = "
                             f"{vocab_size} embedding rows (allowed: at most {vocab_size})")


def check_args(args: ModelArgs, where, keys: dict[str, str]) -> None:
    """What no single value says: KV heads dividing the query heads, a head dimension RoPE can rotate, and the
    rope scalings' numbers; `keys` names each field's key in the file."""
    if args.num_heads % args.num_kv_heads:
        raise ModelLoadError(f"{where}: {keys['num_kv_heads']} = {args.num_kv_heads} does not divide "
                             f"{keys['num_heads']} = {args.num_heads} (allowed: a divisor of it)")
    if args.head_dim % 2:
        raise ModelLoadError(f"{where}: {keys['head_dim']} = {args.head_dim} is odd (allowed: an even number, which "
                             f"RoPE rotates in pairs)")
    for rope in filter(None, (args.rope, args.sliding_rope)):
        factors = rope.freq_factors or ()
        if not all(math.isfinite(f) and f > 0 for f in factors):
            raise ModelLoadError(f"{where}: rope_freqs.weight holds {sorted(factors)[0]!r} (allowed: finite numbers "
                                 f"above 0)")
        if len(factors) not in (0, args.head_dim // 2):
            raise ModelLoadError(f"{where}: rope_freqs.weight has {len(factors)} values (allowed: "
                                 f"{args.head_dim // 2}, half of {keys['head_dim']} = {args.head_dim})")
        if rope.kind == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
            raise ModelLoadError(f"{where}: rope high_freq_factor = {rope.high_freq_factor} is not above "
                                 f"low_freq_factor = {rope.low_freq_factor} (allowed: above it)")


_LAYER = re.compile(r"(?:model\.layers|blk)\.(\d+)\.")


def expected_shapes(args: ModelArgs, ours: set[str]) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor the model reads, by our name (loader.py), for those of `ours` (its tensors present)."""
    h, d, inter = args.hidden_size, args.head_dim, args.intermediate_size
    q, kv = args.num_heads * d, args.num_kv_heads * d
    inside = {"input_norm": (h,), "post_attention_norm": (h,), "pre_feedforward_norm": (h,),
              "post_feedforward_norm": (h,), "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h),
              "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "q_norm": (d,), "k_norm": (d,), "o_proj": (h, q),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter), "qkv_proj": (q + 2 * kv, h),
              "gate_up_proj": (2 * inter, h)}
    shapes = {"embed_tokens": (args.vocab_size, h), "norm": (h,), "lm_head": (args.vocab_size, h)}
    shapes |= {f"layers.{i}.{name}": shape for i in range(args.num_layers) for name, shape in inside.items()}
    return {name: shape for name, shape in shapes.items() if name in ours}


def check_tensors(args: ModelArgs, where, keys: dict[str, str], shapes: dict[str, tuple[int, ...]],
                  names: dict[str, str], layer_names: dict[str, str]) -> None:
    """Before any weight is copied: the layers the file holds tensors of against its layer count, each tensor the
    model needs present (`layer_names`: a layer's, by their name inside it) and each of its shape. `shapes`: the
    file's tensors (rows first), `names`: our name -> theirs for those present (loader._our_names)."""
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if layers != set(range(args.num_layers)):
        raise ModelLoadError(f"{where}: {keys['num_layers']} = {args.num_layers}, but the file holds tensors of "
                             f"{len(layers)} layer(s) (allowed: the layers it holds, numbered from 0)")
    optional = {"q_bias", "k_bias", "v_bias"} if not args.attention_bias else set()
    optional |= {"q_norm", "k_norm"} if not args.qk_norm else set()
    needed = {"embed_tokens", "norm", *(() if args.tie_word_embeddings else ("lm_head",))}
    needed |= {f"layers.{i}.{ours}" for i in range(args.num_layers) for ours in layer_names.values()
               if ours not in optional}
    for name in sorted(needed - set(names), key=lambda n: (n.count("."), n)):
        raise ModelLoadError(f"{where}: the file has no tensor {_theirs(name, layer_names, names)} (allowed: a file "
                             f"with every tensor of the architecture)")
    for name, shape in expected_shapes(args, set(names)).items():
        if tuple(shapes[names[name]]) != shape:
            why = f"{keys['vocab_size']} = {args.vocab_size}, " if name in ("embed_tokens", "lm_head") else ""
            raise ModelLoadError(f"{where}: tensor {names[name]} has shape {list(shapes[names[name]])} (allowed: "
                                 f"{list(shape)}, from {why}the model's other metadata)")


def _theirs(ours: str, layer_names: dict[str, str], names: dict[str, str]) -> str:
    """A missing tensor by its name in the file, where the layer's names tell it (else ours)."""
    index, _, inside = ours.removeprefix("layers.").partition(".")
    theirs = next((t for t, o in layer_names.items() if o == inside), None)
    if not inside or theirs is None:
        return ours
    prefix = "blk." if any(n.startswith("blk.") for n in names.values()) else "model.layers."
    return f"{prefix}{index}.{theirs}"
