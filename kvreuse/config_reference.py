"""The configuration reference, docs/configuration.md, generated from the pydantic models of
kvreuse/config/sections.py.

`python -m kvreuse.config_reference` prints it; `python -m kvreuse.config_reference --write` writes
docs/configuration.md (tests/test_config_reference.py fails while the file differs from `render()`). Types,
defaults, choices, bounds and descriptions all come from the field declarations, so the text is edited there.
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvreuse.config import PRESET_DESCRIPTIONS, PRESETS, Config

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
REGENERATE = "python -m kvreuse.config_reference --write"

_INTRO = f"""\
# Configuration reference

<!-- Generated from kvreuse/config/sections.py by `{REGENERATE}`: edit the descriptions there, not here. -->

kvreuse reads one INI file (`--config FILE`); any key can be overridden with `--set section.key=value`
(repeatable; a nested key is written with its dots, e.g. `--set cache.suffix.recompute_ratio=0.3`).
Precedence: command-line flags > `--set` > the file > the defaults below. Some keys have vLLM-style flags
(`--block-size`, `--max-model-len`, `--enable-prefix-caching` / `--no-enable-prefix-caching`, `--dtype`,
`--device`, `--model`, `--chat-template`, `--quantization`, `--preset`, and for `kvreuse serve` `--host`, `--port`,
`--api-keys`, `--admin-api-keys`, `--served-model-name`, `--replicas`, `--ray-address`); `kvreuse serve --help`
lists them.

The configuration printed in the article kvreuse is built from ([design/article.md](design/article.md)) loads as
written, in its multi-line form or flattened on one line (`examples/article.ini`,
`kvreuse serve --config examples/article.ini`):

```ini
[server]
max_tokens = 2048

[cache]
enabled = true
block_size = 16
max_blocks = 4096
policy = lru
suffix.enabled = true
normalize_input = true
min_match_blocks = 1
```

Booleans take `true`/`false`, `yes`/`no`, `on`/`off` or `1`/`0`; numbers must be finite. An error names the key,
the value and what is allowed, with the closest valid name for a typo:
`unknown config key 'cache.blok_size'; did you mean 'cache.block_size'?`,
`config key 'cache.policy' must be one of lru, lfu, s3fifo, chain, learned, got 'fifo'`; the command line then exits
with code 2.

From Python, each section is a pydantic model (`kvreuse.config.load_config(path, overrides)` returns a `Config`);
values are checked when built and when assigned. `cache.suffix` is immutable: derive a variant with
`with_changes(...)`, which validates it as a config file would.
"""


def _markdown(text: str) -> str:
    """Docstring or description text as Markdown: RST literals to code spans, docs/ paths to relative links."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return re.sub(r"\bdocs/([\w./-]+\.md)", r"[\1](\1)", text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _summary(model: type[BaseModel]) -> str:
    """The first paragraph of a model's docstring, on one line."""
    first = inspect.cleandoc(model.__doc__ or "").split("\n\n")[0]
    return _markdown(" ".join(first.split()))


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    kind = field.annotation
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def choices(field: FieldInfo) -> tuple | None:
    """The values a Literal-typed field allows, or None."""
    return get_args(field.annotation) if get_origin(field.annotation) is Literal else None


def type_name(field: FieldInfo) -> str:
    if choices(field) is not None:
        return "choice"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[field.annotation]


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return '""' if value == "" else str(value)


def allowed(field: FieldInfo) -> str:
    """Choices, numeric bounds and patterns of a field as the reference shows them."""
    options = choices(field)
    if options is not None:
        return ", ".join(f"`{option}`" for option in options)
    if field.annotation is bool:
        return "`true`, `false`"
    parts = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                parts.append(f"{sign} {getattr(meta, attr)}")
        if getattr(meta, "pattern", None):
            parts.append(f"matches `{meta.pattern}`")
    return ", ".join(parts) or "any"


def keys(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(INI key as written in its section, field) for every value of ``model``, nested sections included."""
    for name, field in model.model_fields.items():
        nested = _section_model(field)
        if nested is None:
            yield prefix + name, field
        else:
            yield from keys(nested, f"{prefix}{name}.")


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    lines = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if _section_model(field) is None:
            lines.append(f"| `{prefix}{name}` | {type_name(field)} | `{_value(field.default)}` | "
                         f"{_cell(allowed(field))} | {_cell(_markdown(field.description or ''))} |")
    return lines


def _section(name: str, model: type[BaseModel]) -> list[str]:
    lines = [f"## [{name}]", "", _summary(model), "", *_table(model, ""), ""]
    for child, field in model.model_fields.items():
        nested = _section_model(field)
        if nested is not None:
            lines += [f"### [{name}] {child}.*", "", _summary(nested), "", *_table(nested, f"{child}."), ""]
    return lines


def _presets() -> list[str]:
    lines = ["## Presets", "",
             "`cache.preset` (`--preset`) sets the `[cache]` keys below first; keys written explicitly, in the file "
             "or with `--set`, override it wherever they appear. The four scenarios and the advice for chat, eval "
             "and agent come from the article ([design/article.md](design/article.md)); the `rag` preset and the "
             "segment reuse settings are ours, measured in [benchmarks.md](benchmarks.md).", "",
             "| preset | sets in `[cache]` | for |", "|---|---|---|"]
    for preset, values in PRESETS.items():
        sets = ", ".join(f"`{key} = {value}`" for key, value in values.items()) or "-"
        lines.append(f"| `{preset}` | {sets} | {_cell(PRESET_DESCRIPTIONS[preset])} |")
    return [*lines, ""]


def render() -> str:
    """docs/configuration.md: every section and key of Config (type, default, allowed values, description), then
    the presets."""
    lines = [_INTRO]
    for name, field in Config.model_fields.items():
        lines += _section(name, _section_model(field))
    lines += _presets()
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvreuse.config_reference", description=__doc__.split("\n")[0])
    parser.add_argument("--write", nargs="?", const=str(DOC_PATH), metavar="PATH",
                        help=f"write the reference to PATH (default {DOC_PATH.relative_to(DOC_PATH.parents[1])})")
    args = parser.parse_args(argv)
    if args.write:
        Path(args.write).write_text(render(), encoding="utf-8")
    else:
        print(render(), end="")


if __name__ == "__main__":
    main()
