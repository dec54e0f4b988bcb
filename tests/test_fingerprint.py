"""The fingerprint memo gives the loader's digest, hashes a file again once it changes, and never fails on a bad
memo."""

from __future__ import annotations

import os

import pytest

from kvreuse.weights import fingerprint
from kvreuse.weights.fingerprint import cached_sha256, sha256_of_files


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fingerprints"


@pytest.fixture
def files(tmp_path):
    paths = [tmp_path / "b.safetensors", tmp_path / "a.safetensors"]
    paths[0].write_bytes(b"second" * 1000)
    paths[1].write_bytes(b"first" * 1000)
    return paths


def no_hashing(monkeypatch):
    def fail(paths):
        raise AssertionError("hashed the files again")

    monkeypatch.setattr(fingerprint, "sha256_of_files", fail)


def test_the_digest_is_the_loaders_and_is_remembered(cache, files, monkeypatch):
    expected = sha256_of_files(files)
    assert cached_sha256(files) == expected
    assert len(list(cache.iterdir())) == 1
    no_hashing(monkeypatch)
    assert cached_sha256(files) == expected
    assert cached_sha256(list(reversed(files))) == expected  # the same files, given in another order


def test_a_changed_file_gets_a_new_digest(cache, files):
    before = cached_sha256(files)
    stat = files[0].stat()
    files[0].write_bytes(b"SECOND" * 1000)  # the same size
    os.utime(files[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    after = cached_sha256(files)
    assert after != before and after == sha256_of_files(files)


@pytest.mark.parametrize("memo", ["not json", "[1, 2]", '{"files": [], "sha256": "x"}', ""])
def test_a_corrupt_memo_is_recomputed(cache, files, memo):
    cached_sha256(files)
    [path] = cache.iterdir()
    path.write_text(memo)
    assert cached_sha256(files) == sha256_of_files(files)


def test_a_memo_with_a_wrong_digest_for_other_files_is_not_used(cache, files, monkeypatch):
    cached_sha256(files)
    [path] = cache.iterdir()
    path.write_text(path.read_text().replace(files[0].name, "other.safetensors"))
    assert cached_sha256(files) == sha256_of_files(files)


def test_an_unwritable_cache_still_gives_the_digest(tmp_path, files, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(blocker))
    assert cached_sha256(files) == sha256_of_files(files)
