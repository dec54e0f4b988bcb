"""A chat template given as a file (`--chat-template`, as vLLM's), for a model whose own files carry none."""

from __future__ import annotations

from pathlib import Path

NO_TEMPLATE = ("this model has no chat template (its files carry none, as a base model's): start kvreuse with "
               "--chat-template FILE (a Jinja template; config key model.chat_template), or send a plain prompt "
               "(/v1/completions) instead of messages")


class NoChatTemplate(ValueError):
    """A conversation was given to a model without a chat template."""

    def __init__(self) -> None:
        super().__init__(NO_TEMPLATE)


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
    return text
