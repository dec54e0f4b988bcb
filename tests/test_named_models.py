"""`--model gemma3-270m`: the name resolves to the GGUF its package ships, assembled once into the model cache."""

from __future__ import annotations

import hashlib
import importlib

import pytest

from kvreuse.weights import named_models
from kvreuse.weights.errors import ModelLoadError
from kvreuse.weights.named_models import NamedModel, resolve_named_model

GEMMA = named_models.NAMED_MODELS["gemma3-270m"]


@pytest.fixture(scope="module")
def models_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVREUSE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield named_models.models_dir()


def test_the_name_resolves_to_the_packages_file_with_its_sha256(models_cache):
    path = resolve_named_model("gemma3-270m")
    package = importlib.import_module(GEMMA.package)
    assert path == models_cache / package.MODEL_NAME
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    assert digest.hexdigest() == package.EXPECTED_SHA256
    assert [p.name for p in models_cache.iterdir()] == [package.MODEL_NAME]  # no temporary file left


def test_a_second_resolution_reuses_the_file(models_cache, monkeypatch):
    first = resolve_named_model("gemma3-270m")
    package = importlib.import_module(GEMMA.package)
    monkeypatch.setattr(package, "assemble", lambda **kwargs: pytest.fail("assembled again"))
    assert resolve_named_model("gemma3-270m") == first


def test_a_partial_file_is_assembled_again(models_cache):
    path = resolve_named_model("gemma3-270m")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    assert resolve_named_model("gemma3-270m") == path and path.stat().st_size == size


def test_an_unknown_name_is_not_a_named_model():
    assert resolve_named_model("gemma3-270") is None
    assert resolve_named_model("./gemma3-270m.gguf") is None


def test_a_missing_package_says_what_to_install(monkeypatch):
    missing = NamedModel("kvreuse_no_such_package", "kvreuse-no-such-package==1.0.0", "a test model")
    monkeypatch.setitem(named_models.NAMED_MODELS, "test-model", missing)
    with pytest.raises(ModelLoadError, match=r"'test-model' \(a test model\) is not installed: "
                                             r"pip install kvreuse-no-such-package==1\.0\.0"):
        resolve_named_model("test-model")
