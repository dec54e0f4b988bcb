"""A Hugging Face directory's weight files stay inside it: whatever its `model.safetensors.index.json` names or its
links point to, the loader opens only regular files in the directory (or, for a hub cache snapshot, in its
repository's blobs), and refuses anything else at once with one ModelLoadError naming the index, the shard and why."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from kvreuse.cli import main
from kvreuse.weights.errors import ModelLoadError
from kvreuse.weights.loader import load_model_info, load_weights

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture
def model_dir(tmp_path, tiny_model_dir) -> Path:
    """A copy of the tiny model whose index names its one shard."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    write_index(path, WEIGHTS)
    return path


def write_index(path: Path, *shards) -> None:
    weight_map = {f"tensor.{i}": shard for i, shard in enumerate(shards)}
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def refused(path: Path) -> str:
    """load_model_info's message for `path`, which must be refused at once."""
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as exc:
        load_model_info(path)
    assert time.monotonic() - start < 5
    return str(exc.value)


def test_an_index_naming_files_in_the_directory_loads(model_dir):
    assert load_model_info(model_dir).args.num_layers == 2


@pytest.mark.parametrize("shard", ["../" * 20 + "etc/passwd", "../../../../etc/passwd", "/etc/passwd", "/dev/zero",
                                   "sub/../../model/../../outside.safetensors"])
def test_an_index_naming_a_file_outside_the_directory_is_refused(model_dir, shard):
    write_index(model_dir, WEIGHTS, shard)
    message = refused(model_dir)
    assert message.startswith(f"{model_dir / INDEX}: shard {shard!r} resolves to ")
    assert message.endswith(f"outside the model directory {model_dir.resolve()}")


def test_a_link_pointing_outside_is_refused(model_dir, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(model_dir / WEIGHTS, outside)
    (model_dir / "linked.safetensors").symlink_to(outside)
    write_index(model_dir, "linked.safetensors")
    assert refused(model_dir) == (f"{model_dir / INDEX}: shard 'linked.safetensors' resolves to {outside.resolve()}, "
                                  f"outside the model directory {model_dir.resolve()}")
    (model_dir / INDEX).unlink()  # the same link found by *.safetensors
    assert f"shard 'linked.safetensors' resolves to {outside.resolve()}, outside" in refused(model_dir)


def test_a_link_to_a_device_is_refused(model_dir):
    (model_dir / "zero.safetensors").symlink_to("/dev/zero")
    write_index(model_dir, "zero.safetensors")
    assert "shard 'zero.safetensors' resolves to /dev/zero, outside the model directory" in refused(model_dir)


def test_a_fifo_is_refused_without_being_opened(model_dir):
    os.mkfifo(model_dir / "pipe.safetensors")  # opening it would block until a writer came
    write_index(model_dir, WEIGHTS, "pipe.safetensors")
    assert refused(model_dir) == (f"{model_dir / INDEX}: shard 'pipe.safetensors' is not a regular file "
                                  f"({(model_dir / 'pipe.safetensors').resolve()})")
    (model_dir / INDEX).unlink()
    assert "shard 'pipe.safetensors' is not a regular file" in refused(model_dir)


def test_a_missing_shard_is_named(model_dir):
    write_index(model_dir, "model-00002-of-00002.safetensors")
    assert "shard 'model-00002-of-00002.safetensors' does not exist" in refused(model_dir)


@pytest.mark.parametrize("index", ["{not json", "[]", '{"weight_map": []}', '{"weight_map": {"a": ["x"]}}',
                                   '{"metadata": {}}'])
def test_a_malformed_index_is_named(model_dir, index):
    (model_dir / INDEX).write_text(index)
    assert refused(model_dir).startswith(f"{model_dir / INDEX}: expected a JSON object with a weight_map of tensor "
                                         f"names to shard file names (")


@pytest.mark.parametrize("shard", [7, "", None])
def test_a_shard_that_is_not_a_name_is_refused(model_dir, shard):
    write_index(model_dir, shard)
    assert f"shard {shard!r} is not a file name" in refused(model_dir)


def test_a_hub_cache_snapshot_links_to_its_blobs(model_dir, tmp_path):
    """huggingface_hub's cache layout: snapshots/REVISION/FILE -> ../../blobs/HASH."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(model_dir, snapshot)
    (repo / "blobs").mkdir()
    (snapshot / WEIGHTS).rename(repo / "blobs" / "9f86d081")
    (snapshot / WEIGHTS).symlink_to(Path("..", "..", "blobs", "9f86d081"))
    assert load_weights(snapshot).args.num_layers == 2
    write_index(snapshot, "../../../outside.safetensors")  # the blobs only, not the rest of the cache
    assert "outside the model directory" in refused(snapshot)


def test_the_command_line_says_it_in_one_line(model_dir, capsys):
    shard = "../" * 20 + "etc/passwd"
    write_index(model_dir, shard)
    assert main(["generate", "--model", str(model_dir), "x"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (f"kvreuse: {model_dir / INDEX}: shard {shard!r} resolves to /etc/passwd, outside "
                                    f"the model directory {model_dir.resolve()}")
