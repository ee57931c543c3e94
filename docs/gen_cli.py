"""Render docs/cli.md: every `pagelab` command and option, taken from the typer app (`cli.commands.app`).

`python docs/gen_cli.py` rewrites the page; tests/test_docs.py fails while the committed page differs from
what `render()` returns, so the reference cannot drift from the commands.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"

HEADER = """# Command-line reference

Here: every `pagelab` command and option with the words, choices and defaults `-h` prints
(where `-h` lays them out in panels), generated from the commands themselves by `python docs/gen_cli.py`
(a test fails when this page is out of date); `-h` on any command prints its help. Conventions:
[getting started](getting-started.md#command-line-conventions).
"""


def _escape(text: str) -> str:
    """Text safe in a Markdown list item (option help may hold `|`, `<` or `*`)."""
    return text.replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;")


def _section(command, ctx, seen: dict) -> str:
    """One command: its usage, its description, then each panel's options as a list (a group's commands
    follow as sections of their own, so the page lists them once). An option an earlier section already
    described in the same words (simulate and replay share many) is named, not described again; `seen`
    maps each (option, help) to the first command that printed it."""
    from cli.help import panels

    usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
    lines = [f"`{usage}`", ""]
    for paragraph in (command.help or "").strip().split("\n\n"):
        if paragraph.strip():
            lines += [" ".join(paragraph.split()), ""]
    for title, rows in panels(command, ctx).items():
        if ctx.parent is not None:  # every command has -h; the page says so once, under `pagelab`
            rows = [(name, text) for name, text in rows if name != "-h, --help"]
        if not rows:
            continue
        lines += [f"**{title}**", ""]
        shared: dict[str, list[str]] = {}
        for name, text in rows:
            first = seen.setdefault((name, text), ctx.command_path)
            if first == ctx.command_path:
                lines.append(f"- `{name}`: {_escape(text)}")
            else:
                shared.setdefault(first, []).append(f"`{_short(name)}`")
        for first, names in shared.items():
            lines.append(f"- As in `{first}`: {', '.join(names)}")
        lines.append("")
    return "\n".join(lines)


def _short(name: str) -> str:
    """An option's long name without its metavar ("-o, --out PATH" -> "--out")."""
    parts = [part.strip() for part in name.split(",")]
    return next((p for p in parts if p.startswith("--")), parts[0]).split()[0]


def _sections(command, name: str, parent=None, seen: dict | None = None):
    """(command path, section) of `command` and, depth first, of each of its subcommands."""
    seen = {} if seen is None else seen
    ctx = command.make_context(name, [], parent=parent, resilient_parsing=True)
    yield ctx.command_path, _section(command, ctx, seen)
    if hasattr(command, "list_commands"):
        for sub in command.list_commands(ctx):
            yield from _sections(command.get_command(ctx, sub), sub, ctx, seen)


def render() -> str:
    """The page: a header, then one section per command."""
    import typer.main

    from cli.commands import app

    root = typer.main.get_command(app)
    # simulate is the command most readers start from: it describes the options it shares with others.
    seen: dict = {}
    root_ctx = root.make_context("pagelab", [], resilient_parsing=True)
    for _ in _sections(root.get_command(root_ctx, "simulate"), "simulate", root_ctx, seen):
        pass
    sections = [HEADER]
    for path, text in _sections(root, "pagelab", seen=seen):
        level = "#" * min(path.count(" ") + 2, 4)
        sections.append(f"{level} `{path}`\n\n{text}")
    return "\n".join(sections).rstrip() + "\n"


def main() -> None:
    """Write the page."""
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
