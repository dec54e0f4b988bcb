"""A format's size against `[structured]`'s limits, checked before any xgrammar work (whose cost grows with it):
its bytes, then the properties a schema declares."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from kvreuse.config import StructuredConfig
from kvreuse.structured.errors import UnsupportedFormat
from kvreuse.structured.formats import FormatSpec
from kvreuse.structured.schema_check import SUBSCHEMA_LIST, SUBSCHEMA_MAP, SUBSCHEMA_ONE


def check_limits(spec: FormatSpec, limits: StructuredConfig) -> None:
    """UnsupportedFormat naming the request field, the limit and its key when `spec` is over one of them."""
    size = len(spec.value.encode()) if spec.value else 0
    if size > limits.max_schema_bytes:
        raise UnsupportedFormat(spec.field, f"{spec.field}: the {spec.noun} is {size} bytes, at most "
                                            f"{limits.max_schema_bytes} allowed (structured.max_schema_bytes)")
    if spec.kind == "json_schema":
        schemas = [json.loads(spec.value)]
    elif spec.kind == "tool_calls":
        schemas = [call["schema"] for call in json.loads(spec.value)["calls"]]
    else:
        return
    properties = sum(map(count_properties, schemas))
    whose = "the schema declares" if spec.kind == "json_schema" else "the tools' parameters declare"
    if properties > limits.max_schema_properties:
        raise UnsupportedFormat(spec.field, f"{spec.field}: {whose} {properties} properties, at most "
                                            f"{limits.max_schema_properties} allowed "
                                            f"(structured.max_schema_properties)")


def count_properties(schema: Any) -> int:
    """Properties declared by every object of `schema` (its `$defs` included), each counted once."""
    return sum(len(sub["properties"]) for sub in _subschemas(schema) if isinstance(sub.get("properties"), dict))


def _subschemas(schema: Any) -> Iterator[dict]:
    """`schema` and every schema inside it, depth first, without recursion (a schema may nest deeply)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        stack.extend(node[keyword] for keyword in SUBSCHEMA_ONE if keyword in node)
        for keyword in SUBSCHEMA_LIST:
            if isinstance(node.get(keyword), list):
                stack.extend(node[keyword])
        for keyword in SUBSCHEMA_MAP:
            if isinstance(node.get(keyword), dict):
                stack.extend(node[keyword].values())
