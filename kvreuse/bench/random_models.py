"""Hugging Face model directories with random weights, built by transformers from a config alone: what parity and
throughput checks run where no checkpoint can travel (a GPU machine that reaches no registry). A model of a real
model's config costs exactly what its real weights would.

`RANDOM_MODELS` is the table of what can be built: per architecture (an HF `model_type`), a tiny model for parity
and, where one is named, a full-size one. Adding an architecture is adding its rows.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class RandomModel:
    """A model to build: `name` (its directory's name), its HF `model_type` and the config keys that differ from
    transformers' defaults; `tiny`: small enough for a CPU check; `bench`: the model the throughput benches run."""
    name: str
    model_type: str
    config: dict = field(default_factory=dict)
    tiny: bool = False
    bench: bool = False


# SmolLM2-135M's own config.json (the embedded model's architecture), and a 2-layer model with the same vocabulary.
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 8192, "tie_word_embeddings": True}
TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 4096, "tie_word_embeddings": False}

TINY_GEMMA3 = {**TINY_LLAMA, "num_hidden_layers": 3, "sliding_window": 24, "tie_word_embeddings": True,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}

RANDOM_MODELS = (
    RandomModel("llama-tiny", "llama", TINY_LLAMA, tiny=True),
    RandomModel("mistral-tiny", "mistral", {**TINY_LLAMA, "sliding_window": 24}, tiny=True),
    RandomModel("qwen2-tiny", "qwen2", TINY_LLAMA, tiny=True),
    RandomModel("qwen3-tiny", "qwen3", TINY_LLAMA, tiny=True),
    RandomModel("gemma3-tiny", "gemma3_text", TINY_GEMMA3, tiny=True),
    RandomModel("phi3-tiny", "phi3", {**TINY_LLAMA, "sliding_window": 24}, tiny=True),
    RandomModel("smollm2-135m", "llama", SMOLLM2_135M, bench=True),
)


def select(architectures: list[str] | None = None, names: list[str] | None = None,
           tiny_only: bool = False) -> list[RandomModel]:
    """The table's models of `architectures` and `names` (None: any), the tiny ones alone with `tiny_only`;
    ValueError for a name or architecture the table lacks."""
    unknown = sorted({*(architectures or ())} - {m.model_type for m in RANDOM_MODELS}
                     | {*(names or ())} - {m.name for m in RANDOM_MODELS})
    if unknown:
        raise ValueError(f"not in random_models.RANDOM_MODELS: {', '.join(unknown)}")
    return [m for m in RANDOM_MODELS if (architectures is None or m.model_type in architectures)
            and (names is None or m.name in names) and (m.tiny or not tiny_only)]


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn at random (a tied one once), so none keeps a value a loader could get right by
    accident: matrices N(0, 1/fan_in) (unit-scale activations), norm weights 1 + N(0, 0.1^2), biases N(0, 0.02^2).
    Logits then spread over a few units, so greedy choices are rarely near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.dim() >= 2:
                value = noise * p.shape[-1] ** -0.5
            elif name.endswith("bias"):
                value = noise * 0.02
            else:
                value = 1.0 + 0.1 * noise
            p.copy_(value)


def build(spec: RandomModel, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """`out`/<name>: the model's config.json and model.safetensors (fp32) written by transformers, with the tokenizer
    files of `tokenizer_dir` beside them; the vocabulary and special token ids are the tokenizer's. Returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad")}
    config = AutoConfig.for_model(spec.model_type, vocab_size=len(tokenizer), **ids, **spec.config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    path = out / spec.name
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(str(path))
    for file in tokenizer_dir.iterdir():
        if file.is_file():
            shutil.copy(file, path / file.name)
    return path
