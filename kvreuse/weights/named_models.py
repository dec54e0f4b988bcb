"""Models known by name (`--model gemma3-270m`): a GGUF shipped in Python packages, assembled once into the model
cache, so that a name works offline wherever its package is installed."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from pathlib import Path

from kvreuse.cache_dir import cache_root
from kvreuse.config.named_models import NAMED_MODELS, NamedModel
from kvreuse.weights.errors import ModelLoadError


def models_dir() -> Path:
    """Where named models are assembled: `cache_root() / "models"`."""
    return cache_root() / "models"


def resolve_named_model(name: str) -> Path | None:
    """The GGUF file `name` stands for, assembled from its package into `models_dir()` the first time (its sha256
    checked then) and reused after; None if `name` is not a model name. ModelLoadError if its package is missing
    or the file cannot be assembled."""
    model = NAMED_MODELS.get(name)
    if model is None:
        return None
    package = _import(name, model)
    target = models_dir() / package.MODEL_NAME
    expected_size = sum(chunk.stat().st_size for chunk in package.chunk_paths())
    if target.is_file() and target.stat().st_size == expected_size:
        return target
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        package.assemble(output_path=tmp, overwrite=True)  # joins the chunks and checks the sha256
        os.replace(tmp, target)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not assemble model {name!r} into {target}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return target


def _import(name: str, model: NamedModel):
    if importlib.util.find_spec(model.package) is None:
        raise ModelLoadError(f"model {name!r} ({model.description}) is not installed: pip install {model.requirement}")
    package = importlib.import_module(model.package)
    try:
        package.verify_chunks()
    except (FileNotFoundError, ImportError) as exc:
        raise ModelLoadError(f"model {name!r} is installed incompletely ({exc}): pip install --force-reinstall "
                             f"{model.requirement}") from exc
    return package
