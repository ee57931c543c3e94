"""Help pages as panels: each option in the panel its declaration names, with its choices and default.

Typer's own rich help cuts option names and descriptions with "..." on an 80-column terminal, and click's
plain help lists forty options in one run. Here every option keeps its whole name, and its description
wraps; when the terminal is too narrow for two columns the description goes under the name. A group's
page lists each command with its whole first paragraph. On a terminal each panel is a box; piped, or
rendered at a given width (docs/gen_cli.py), it is a `Title:` line over its rows.
"""
from __future__ import annotations

import io
import shutil
import sys
import types
import typing
from pathlib import Path

from rich import box
from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

# The panels of simulate and replay (other commands name theirs, or keep one "Options" panel).
TRACE, POOL, SCHEDULER, OUTPUT, VLLM = ("Trace", "Model and pool", "Scheduler and timing", "Output",
                                        "vLLM compatibility")
OPTIONS_PANEL = "Options"  # where options that name no panel go
HELP_PANEL = OUTPUT  # -h joins this panel when the command has it
MAX_WIDTH = 100
MIN_HELP_WIDTH = 30  # narrower than this and descriptions go under the option names
INLINE_CHOICES = 30  # name + choices up to this many characters show the choices as the metavar
_METAVARS = {int: "INT", float: "FLOAT", str: "TEXT", Path: "PATH", bool: ""}


def _width(ctx) -> int:
    """The width click was asked for (a generated reference sets one), else the terminal's (COLUMNS when
    set), at most MAX_WIDTH or the context's max_content_width."""
    width = ctx.terminal_width or shutil.get_terminal_size((80, 24)).columns
    return min(width, ctx.max_content_width or MAX_WIDTH)


def _annotation(param):
    """The parameter's declared type (typer keeps it on the click parameter)."""
    descriptor = getattr(param, "type_descriptor", None)
    return getattr(descriptor, "annotation", None)


def choices(param) -> tuple[str, ...]:
    """The values a Literal-typed option accepts (empty for other types)."""
    annotation = _annotation(param)
    args = [a for a in typing.get_args(annotation) if a is not type(None)] if annotation is not None else []
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(map(str, args))
    literal = [a for a in args if typing.get_origin(a) is typing.Literal]  # Optional[Literal[...]]
    return tuple(str(v) for a in literal for v in typing.get_args(a))


def _metavar(param) -> str:
    """What follows the option's name: its metavar, or a word for its type."""
    if param.metavar:
        return param.metavar
    if getattr(param, "is_flag", False):
        return ""
    annotation = _annotation(param)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    inner = args[0] if typing.get_origin(annotation) in (list, typing.Union, types.UnionType) and args \
        else annotation
    return _METAVARS.get(inner, "VALUE")


def option_name(param) -> str:
    """'-a, --allocator TEXT', '--[no-]prefix-caching', '--preemption recompute|swap'."""
    if param.param_type_name == "argument":
        return (param.metavar or param.name).upper()
    opts = sorted(param.opts, key=lambda o: (o.startswith("--"), o))
    secondary = list(param.secondary_opts)
    if len(opts) == 1 and len(secondary) == 1 and secondary[0] == "--no-" + opts[0].removeprefix("--"):
        names = "--[no-]" + opts[0].removeprefix("--")
    else:
        names = ", ".join(opts + secondary)
    allowed = choices(param)
    inline = "|".join(allowed)
    if allowed and len(names) + 1 + len(inline) <= INLINE_CHOICES:
        return f"{names} {inline}"
    metavar = "NAME" if allowed else _metavar(param)
    return f"{names} {metavar}".rstrip()


def _default_text(param) -> str | None:
    """The default as the user would type it, or None when there is none to show."""
    if not getattr(param, "show_default", False) or param.required:
        return None
    default = param.default
    if getattr(param, "is_flag", False):
        if param.secondary_opts:
            return "on" if default else "off"
        return None  # a lone flag is off unless given
    if default is None or default == [] or default == ():
        return None
    if isinstance(default, (list, tuple)):
        return ",".join(map(str, default))
    return str(getattr(default, "value", default))


def option_help(param) -> str:
    """The description with what the option accepts and its default appended."""
    text = " ".join((param.help or "").split())
    extra = []
    allowed = choices(param)
    if allowed and "|".join(allowed) not in option_name(param):
        extra.append("choices: " + ", ".join(allowed))
    default = _default_text(param)
    if default is not None:
        extra.append(f"default: {default}")
    if param.required and param.param_type_name == "option":
        extra.append("required")
    return f"{text} [{'; '.join(extra)}]".strip() if extra else text


def panels(command, ctx) -> dict[str, list[tuple[str, str]]]:
    """Panel title -> (name, description) rows, in declaration order; -h joins HELP_PANEL if present."""
    out: dict[str, list[tuple[str, str]]] = {}
    help_option = command.get_help_option(ctx)
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False) or param is help_option:
            continue
        title = getattr(param, "rich_help_panel", None) or OPTIONS_PANEL
        out.setdefault(title, []).append((option_name(param), option_help(param)))
    if help_option is not None:
        title = HELP_PANEL if HELP_PANEL in out else OPTIONS_PANEL
        out.setdefault(title, []).append((option_name(help_option), "Show this help and exit."))
    return out


def first_paragraph(text: str | None) -> str:
    """A command's description for a group's list: its docstring's first paragraph, on one line."""
    return " ".join((text or "").strip().split("\n\n")[0].split())


def _rows_panel(title: str, rows: list[tuple[str, str]], width: int, boxed: bool):
    """One panel: names and descriptions side by side, or stacked when the terminal is narrow; in a box on
    a terminal, else under a `Title:` line (pipes and generated references stay plain and small)."""
    name_width = max(len(name) for name, _ in rows)
    inner = width - (4 if boxed else 2)
    if inner - name_width - 2 >= MIN_HELP_WIDTH:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True, min_width=name_width)
        grid.add_column(overflow="fold")
        for name, text in rows:
            grid.add_row(Text(name, style="bold"), Text(text))
        body = grid
    else:
        body = Group(*(part for name, text in rows
                       for part in (Text(name, style="bold"), Padding(Text(text), (0, 0, 0, 4)))))
    if boxed:
        return Panel(body, title=title, title_align="left", box=box.ROUNDED, padding=(0, 1))
    return Group(Text(f"{title}:", style="bold"), Padding(body, (0, 0, 0, 2)), Text(""))


def render(command, ctx, boxed: bool | None = None) -> str:
    """The whole help page of a command or group (`boxed`: panels in boxes; default: when stdout is a
    terminal and no width was imposed)."""
    width = _width(ctx)
    if boxed is None:
        boxed = sys.stdout.isatty() and ctx.terminal_width is None
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, no_color=True, highlight=False, emoji=False,
                      force_terminal=False, legacy_windows=False, markup=False)
    formatter = ctx.make_formatter()
    command.format_usage(ctx, formatter)
    console.print(formatter.getvalue().rstrip(), soft_wrap=False)
    if command.help:
        console.print()
        for paragraph in command.help.strip().split("\n\n"):
            console.print(" ".join(paragraph.split()))
    console.print()
    for title, rows in panels(command, ctx).items():
        console.print(_rows_panel(title, rows, width, boxed))
    if isinstance(command, TyperGroup):
        listed = [(name, command.get_command(ctx, name)) for name in command.list_commands(ctx)]
        rows = [(name, first_paragraph(cmd.help)) for name, cmd in listed
                if cmd is not None and not cmd.hidden]
        if rows:
            console.print(_rows_panel("Commands", rows, width, boxed))
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"


class PanelCommand(TyperCommand):
    """A typer command whose help is drawn in panels (see the module docstring)."""

    def format_help(self, ctx, formatter) -> None:
        """Write the panel help into click's formatter."""
        formatter.write(render(self, ctx))


class PanelGroup(TyperGroup):
    """A typer group whose help is drawn in panels, listing each command's whole description."""

    def format_help(self, ctx, formatter) -> None:
        """Write the panel help into click's formatter."""
        formatter.write(render(self, ctx))


def use_panels(app) -> None:
    """Give `app`, its commands and its sub-apps panel help (those that chose no class of their own)."""
    app.info.cls = PanelGroup
    for command in app.registered_commands:
        if command.cls in (None, TyperCommand):  # typer's default
            command.cls = PanelCommand
    for group in app.registered_groups:
        use_panels(group.typer_instance)
