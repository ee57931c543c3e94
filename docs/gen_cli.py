"""Render docs/cli.md: the help of every `pagelab` command, taken from the typer app (`cli.commands.app`).

`python docs/gen_cli.py` rewrites the page; tests/test_docs.py fails while the committed page differs from
what `render()` returns, so the reference cannot drift from the commands.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"
WIDTH = 120  # help text wrapped at a fixed width, whatever the terminal: the page is the same everywhere

HEADER = """# Command-line reference

What you get here: the help of every `pagelab` command and option, as `-h` prints it, generated from the
commands themselves by `python docs/gen_cli.py` (a test fails when this page is out of date). Shared
conventions: [getting started](getting-started.md#command-line-conventions).
"""


def _helps(command, name: str, parent=None):
    """(command path, help text) of `command` and, depth first, of each of its subcommands."""
    ctx = command.make_context(name, [], parent=parent, resilient_parsing=True, terminal_width=WIDTH,
                               max_content_width=WIDTH)
    yield ctx.command_path, command.get_help(ctx)
    if hasattr(command, "list_commands"):
        for sub in command.list_commands(ctx):
            yield from _helps(command.get_command(ctx, sub), sub, ctx)


def render() -> str:
    """The page: a header, then one section per command with its help in a code block."""
    import typer.main

    from cli.commands import app

    sections = [HEADER]
    for path, text in _helps(typer.main.get_command(app), "pagelab"):
        level = "#" * min(path.count(" ") + 2, 4)
        sections.append(f"{level} `{path}`\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(sections)


def main() -> None:
    """Write the page."""
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
