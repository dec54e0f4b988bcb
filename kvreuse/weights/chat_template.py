"""A conversation given to a model without a chat template: refused, naming the flag that gives one
(`--chat-template`, as vLLM's). The file such a flag names is checked by `kvreuse.config.chat_template`."""

from __future__ import annotations

NO_TEMPLATE = ("this model has no chat template (its files carry none, as a base model's): start kvreuse with "
               "--chat-template FILE (a Jinja template; config key model.chat_template), or send a plain prompt "
               "(/v1/completions) instead of messages")


class NoChatTemplate(ValueError):
    """A conversation was given to a model without a chat template."""

    def __init__(self) -> None:
        super().__init__(NO_TEMPLATE)
