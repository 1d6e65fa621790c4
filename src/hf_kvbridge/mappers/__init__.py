"""Mappers: from the selected source layers' KV rows to one target layer's KV rows."""

from .ridge import KVMapper, solve_ridge

__all__ = ["KVMapper", "solve_ridge"]
