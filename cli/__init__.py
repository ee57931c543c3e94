"""pagelab command line: the only place that parses arguments, prints, and writes run folders.

Each command group lives in its own module and registers itself on `app` when imported below.
"""
import typer

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="pagelab: see where KV-cache memory goes in LLM serving.",
)


def main() -> None:
    """Console-script entry point."""
    app()


# Command modules register themselves on `app`; keep these imports at the bottom.
from cli import bench, plot, replay, simulate, sweep, trace  # noqa: E402,F401,I001
