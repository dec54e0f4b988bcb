"""Moved to auth.py. Kept only while kvreuse/cli.py still imports it from here; delete once cmd_serve
calls lifecycle.serve."""

from kvreuse.server.auth import load_api_keys

__all__ = ["load_api_keys"]
