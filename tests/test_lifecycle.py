"""`kvreuse serve`'s start: the HTTP app's modules are imported while the model loads, and a failure of that import
(Python 3.11's imports on two threads at once can fail for a module that exists) is left to the import after it."""

from __future__ import annotations

import importlib
import logging
import sys

from kvreuse.server import lifecycle


def test_the_app_prefetch_imports_the_app():
    lifecycle.prefetch_app()
    assert lifecycle.APP_MODULE in sys.modules


def test_a_failed_app_prefetch_is_reported_and_does_not_raise(monkeypatch, caplog):
    def refuse(name: str):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(lifecycle.importlib, "import_module", refuse)
    with caplog.at_level(logging.WARNING, logger=lifecycle.__name__):
        lifecycle.prefetch_app()
    assert "importing the HTTP app while the model loaded failed (ModuleNotFoundError" in caplog.text
    monkeypatch.undo()
    assert importlib.import_module("kvreuse.server.app").create_app  # the import after the load still works
