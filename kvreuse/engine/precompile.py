"""The process that builds a model's compiled decode step (model/graph_store.py), started by its engine's DecodeGraph
at the lowest CPU priority: `python -m kvreuse.engine.precompile MODEL_CONFIG_JSON [MAX_MODEL_LEN] KEY_JSON`.

It builds the model from the engine's resolved `[model]` section (`ResolvedModel.model_config`) and the context it
serves (`ResolvedModel.max_model_len`: the RoPE tables' length, part of the model's digest), and the graphs only
if its model has the key the engine asked for: a model that came out otherwise (another measured kernel row limit,
say) builds nothing, and the engine says so and decodes eagerly.
"""

from __future__ import annotations

import json
import logging
import sys

from kvreuse.config import ModelConfig


def precompile_command(model: ModelConfig, max_model_len: int | None = None) -> list[str]:
    """The command, but for the key the DecodeGraph appends, that builds the graphs of the model `model` makes with
    RoPE tables `max_model_len` long (None: the default `server.max_tokens`'s)."""
    length = [] if max_model_len is None else [str(max_model_len)]
    return [sys.executable, "-m", "kvreuse.engine.precompile", model.model_dump_json(), *length]


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvreuse.config import Config, ServerConfig
    from kvreuse.engine.built_model import build_model
    from kvreuse.engine.resolved_model import resolve_model
    from kvreuse.model.decode_graph import build_graphs, row_buckets
    from kvreuse.model.graph_store import graph_key

    config, key = ModelConfig.model_validate_json(argv[0]), json.loads(argv[-1])
    server = ServerConfig(max_tokens=int(argv[1])) if len(argv) == 3 else ServerConfig()  # the RoPE tables' length
    model = build_model(resolve_model(Config(model=config, server=server))).model  # the default [cache]: no graph
    # depends on it
    buckets = [tuple(b) for b in key["buckets"]]
    own = graph_key(model, row_buckets(model, buckets[-1][1]))
    if own != key:
        differs = sorted(name for name in key.keys() | own.keys() if key.get(name) != own.get(name))
        print(f"the model built here is not the engine's (it differs in {', '.join(differs)}): nothing built",
              file=sys.stderr)
        return 3
    print(f"built {build_graphs(model, buckets, key)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
