"""`kvreuse serve`: the OpenAI-compatible HTTP server, one engine or --replicas N on Ray Serve."""

from __future__ import annotations

import argparse
import sys

from kvreuse.cli.common import build_config, common_flags, positive_int, shorthand


def add_serve(sub) -> None:
    """The `serve` command."""
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    common_flags(serve)
    serve.add_argument("--host", help=f"{shorthand('host')} (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help=f"{shorthand('port')} (default 8000; 0 = any free port)")
    serve.add_argument("--api-keys", help=f"file of API keys -> tenants ({shorthand('api_keys')})")
    serve.add_argument("--admin-api-keys", help=f"file of the API keys that may call /reset_prefix_cache, "
                                                f"/cache/stats and /metrics ({shorthand('admin_api_keys')})")
    serve.add_argument("--served-model-name", metavar="NAME",
                       help=f"the model id clients send ({shorthand('served_model_name')}; default: the --model "
                            f"name, or the weights file's name)")
    serve.add_argument("--replicas", type=positive_int,
                       help=f"engine replicas on Ray Serve behind one endpoint ({shorthand('replicas')}; default 1: "
                            f"no Ray)")
    serve.add_argument("--ray-address", help=f"a Ray cluster to join ({shorthand('ray_address')}; default: start "
                                             f"one for the server's lifetime)")
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until stopped; the exit code of the server or of the cluster that failed to start."""
    config = build_config(args)
    if config.cluster.replicas > 1:
        from kvreuse.cluster.launch import ClusterStartError, serve_cluster

        try:
            return serve_cluster(config, log_level=args.log_level)
        except ClusterStartError as exc:
            print(f"kvreuse: {exc}", file=sys.stderr)
            return 1
    from kvreuse.server.lifecycle import serve

    return serve(config, log_level=args.log_level)
