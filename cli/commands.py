"""The `pagelab` typer app: the root options, every command registered on it, and the entry point.

The command modules define plain functions (and the `trace` and `bench` sub-apps); this module registers
them, so no command module imports the module that imports it.
"""
import signal
import sys

import typer

from cli.bench import bench_app
from cli.calibrate import calibrate_cmd
from cli.compare import compare_cmd
from cli.export import export_cmd
from cli.help import use_panels
from cli.plan import plan_cmd
from cli.plot import plot_cmd
from cli.presets import presets_cmd
from cli.replay import replay_cmd
from cli.simulate import simulate_cmd
from cli.sweep import sweep_cmd
from cli.trace import trace_app
from cli.view import view_cmd

HELP = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=HELP,
    rich_markup_mode=None,  # help is drawn by cli/help.py: panels that never cut a name or a description
    help="pagelab: see where KV-cache memory goes in LLM serving.",
)


def _version_callback(value: bool) -> None:
    if value:
        from cli.runs import versions

        v = versions()
        typer.echo(f"pagelab {v['pagelab']} (Python {v['python']}, torch {v['torch'] or 'not installed'})")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(None, "--version", "-V", callback=_version_callback, is_eager=True,
                                       help="Print pagelab, Python and torch versions and exit.")) -> None:
    """pagelab: see where KV-cache memory goes in LLM serving."""


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
    try:
        code = app(args=spread_goodput(sys.argv[1:]), prog_name="pagelab", standalone_mode=False)
    except ClickException as exc:
        if exc.__class__.__name__ == "NoArgsIsHelpError":
            exc.show()  # prints the help
        else:
            _one_line(exc)
        sys.exit(exc.exit_code)
    except Abort:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


# Registration order is `pagelab --help`'s order (typer lists the commands, then the groups).
app.add_typer(bench_app, name="bench")
app.command("calibrate")(calibrate_cmd)
app.command("compare")(compare_cmd)
app.command("export")(export_cmd)
app.command("plan")(plan_cmd)
app.command("plot")(plot_cmd)
app.command("presets")(presets_cmd)
app.command("replay")(replay_cmd)
app.command("simulate")(simulate_cmd)
app.command("sweep")(sweep_cmd)
app.command("view")(view_cmd)
app.add_typer(trace_app, name="trace")
use_panels(app)
