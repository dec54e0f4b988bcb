"""A chat template given as a file (`--chat-template`, config key `model.chat_template`), checked when the config
loads: compiled once as transformers runs it, and refused if it would load other templates (also checked of a
model's own template, by the tokenizer)."""

from __future__ import annotations

import functools
from pathlib import Path


class UnsupportedChatTemplate(ValueError):
    """A chat template that loads other templates ({% include %}, {% import %}, {% extends %}): its sandbox has none
    to load, so it cannot render."""


LOADING_TAGS = {"Include": "{% include %}", "Import": "{% import %}", "FromImport": "{% from ... import %}",
                "Extends": "{% extends %}"}


def check_self_contained(template: str | dict[str, str], where: str) -> None:
    """UnsupportedChatTemplate naming `where` ("the chat template") and the first tag of `template` (a text, or
    transformers' named texts) that would load another template."""
    for text in template.values() if isinstance(template, dict) else (template,):
        if (tag := _loading_tag(text)) is not None:
            raise UnsupportedChatTemplate(f"{where} uses {tag}, which kvreuse cannot render: a chat template must "
                                          f"be self-contained (there are no other templates to include, import or "
                                          f"extend)")


@functools.lru_cache(maxsize=16)
def _loading_tag(text: str) -> str | None:
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tree = _compile_jinja_template(text).environment.parse(text)
    found = next(tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)), None)
    return None if found is None else f"{LOADING_TAGS[type(found).__name__]} on line {found.lineno}"


def load_chat_template(path: str | Path) -> str:
    """The template text of `path`, compiled once as transformers runs it (a sandboxed jinja2), so that a typo
    fails at start rather than at the first chat request. ValueError naming the file and the problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the chat template file {path}: {exc}") from None
    if not text.strip():
        raise ValueError(f"the chat template file {path} is empty")
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateError as exc:
        line = f"line {exc.lineno}: " if getattr(exc, "lineno", None) else ""
        raise ValueError(f"the chat template file {path} is not a valid Jinja template ({line}{exc.message})") from None
    check_self_contained(text, f"the chat template file {path}")
    return text
