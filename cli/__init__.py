"""pagelab command line: the only place that parses arguments, prints, and writes run folders.

`cli.app` holds the typer app and registers the commands, which live one group per module.
"""
from pagelab.malloc import choose_arrow_pool, one_arena

# Before anything imports numpy or pyarrow: see pagelab/malloc.py (one malloc arena, and Arrow on its
# jemalloc pool, keep a long run's RSS flat).
one_arena()
choose_arrow_pool()

from cli.app import app, main  # noqa: E402

__all__ = ["app", "main"]
