"""The `pagelab` typer app: the root options, the command registry, and the entry point.

The command modules define plain functions (and the `trace` and `bench` sub-apps); this module registers
them, so no command module imports the module that imports it. `main` registers only the command it is
asked to run (all of them for `pagelab -h` or a name it does not know), so a command starts without
importing the others; `app` holds every command.
"""
import importlib
import signal
import sys
from collections.abc import Iterable

import typer

from cli.help import use_panels

# name: (module, attribute). Registration order is `pagelab --help`'s order (typer lists the commands,
# then the groups); a group is a typer sub-app.
COMMANDS = {
    "calibrate": ("cli.calibrate", "calibrate_cmd"),
    "compare": ("cli.compare", "compare_cmd"),
    "export": ("cli.export", "export_cmd"),
    "plan": ("cli.plan", "plan_cmd"),
    "plot": ("cli.plot", "plot_cmd"),
    "presets": ("cli.presets", "presets_cmd"),
    "replay": ("cli.replay", "replay_cmd"),
    "simulate": ("cli.simulate", "simulate_cmd"),
    "sweep": ("cli.sweep", "sweep_cmd"),
    "view": ("cli.view", "view_cmd"),
}
GROUPS = {
    "bench": ("cli.bench", "bench_app"),
    "trace": ("cli.trace", "trace_app"),
}
HELP = {"help_option_names": ["-h", "--help"]}


def _version_callback(value: bool) -> None:
    if value:
        from cli.runs import versions

        v = versions()
        typer.echo(f"pagelab {v['pagelab']} (Python {v['python']}, torch {v['torch'] or 'not installed'})")
        raise typer.Exit()


def _root(version: bool = typer.Option(None, "--version", "-V", callback=_version_callback, is_eager=True,
                                       help="Print pagelab, Python and torch versions and exit.")) -> None:
    """pagelab: see where KV-cache memory goes in LLM serving."""


def build_app(names: Iterable[str] | None = None) -> typer.Typer:
    """The `pagelab` app with the named commands and groups registered (None: all of them)."""
    wanted = set(COMMANDS) | set(GROUPS) if names is None else set(names)
    app = typer.Typer(
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings=HELP,
        rich_markup_mode=None,  # help is drawn by cli/help.py: panels that never cut a name or a description
        help="pagelab: see where KV-cache memory goes in LLM serving.",
    )
    app.callback()(_root)
    for name, (module, attr) in {**GROUPS, **COMMANDS}.items():
        if name in wanted:
            target = getattr(importlib.import_module(module), attr)
            if name in GROUPS:
                app.add_typer(target, name=name)
            else:
                app.command(name)(target)
    use_panels(app)
    return app


def __getattr__(name: str):
    if name == "app":  # every command: what `pagelab -h` lists and tests drive
        return build_app()
    raise AttributeError(f"module 'cli.commands' has no attribute {name!r}")


def _terminate(signum, frame) -> None:
    """SIGTERM unwinds like Ctrl-C, so half-written run folders are removed on the way out."""
    sys.exit(128 + signum)


def spread_goodput(argv: list[str]) -> list[str]:
    """vLLM writes `--goodput ttft:200 tpot:50` (several values after one flag); click takes one value per
    flag, so the further words that read as limits (`METRIC:VALUE`, simulator/slo.py) become further
    `--goodput` options."""
    from simulator.slo import starts_limit

    out: list[str] = []
    expect_value = after_value = False
    for arg in argv:
        if expect_value:
            expect_value, after_value = False, True
        elif after_value and starts_limit(arg):
            out += ["--goodput", arg]
            continue
        else:
            after_value = False
            expect_value = arg == "--goodput"
        out.append(arg)
    return out


def _one_line(exc) -> None:
    """A usage error (e.g. `--num 1e11` for a whole number) as one line, like every other error."""
    from rich.markup import escape

    from cli.common import err_console

    ctx = getattr(exc, "ctx", None)
    hint = f" (see `{ctx.command_path} -h`)" if ctx is not None else ""
    # typer words a refused choice "Value error, 'x' is not one of ...": the first two words say nothing.
    message = " ".join(exc.format_message().replace("Value error, ", "").split())
    err_console.print(f"[bold red]error:[/] {escape(message)}{escape(hint)}", emoji=False)


def main() -> None:
    """Console-script entry point."""
    from typer._click.exceptions import ClickException
    from typer.exceptions import Abort

    signal.signal(signal.SIGTERM, _terminate)
    args = spread_goodput(sys.argv[1:])
    known = bool(args) and (args[0] in COMMANDS or args[0] in GROUPS)
    app = build_app(args[:1] if known else None)
    try:
        code = app(args=args, prog_name="pagelab", standalone_mode=False)
    except ClickException as exc:
        if exc.__class__.__name__ == "NoArgsIsHelpError":
            exc.show()  # prints the help
        else:
            _one_line(exc)
        sys.exit(exc.exit_code)
    except Abort:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
