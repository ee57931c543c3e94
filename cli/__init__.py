"""pagelab command line: the only place that parses arguments, prints, and writes run folders.

`cli.commands` holds the typer app and registers the commands, which live one group per module. Importing
this package loads none of them: `main` and `app` load `cli.commands` when first used.
"""
from pagelab.malloc import choose_arrow_pool, one_arena

# Before anything imports numpy or pyarrow: see pagelab/malloc.py (one malloc arena, and Arrow on its
# jemalloc pool, keep a long run's RSS flat).
one_arena()
choose_arrow_pool()


def main() -> None:
    """Console-script entry point (`pagelab`)."""
    from cli.commands import main as run

    run()


def __getattr__(name: str):
    if name == "app":
        from cli.commands import app

        return app
    raise AttributeError(f"module 'cli' has no attribute {name!r}")


__all__ = ["app", "main"]
