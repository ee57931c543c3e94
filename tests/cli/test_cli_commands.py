"""The command registry: a command registered alone behaves as it does among all, and starts alone."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.commands import COMMANDS, GROUPS, build_app

ROOT = Path(__file__).resolve().parents[2]


def _help(app: typer.Typer, *path: str) -> str:
    """`pagelab PATH... -h` at 100 columns."""
    return CliRunner().invoke(app, [*path, "-h"], env={"COLUMNS": "100"}, prog_name="pagelab").output


def _help_pages(app: typer.Typer, name: str) -> list[str]:
    """`pagelab NAME -h`, and `pagelab NAME SUB -h` for each command of a group."""
    group = typer.main.get_command(app)
    command = group.get_command(group.make_context("pagelab", [], resilient_parsing=True), name)
    return [_help(app, name)] + [_help(app, name, sub) for sub in getattr(command, "commands", {})]


@pytest.mark.parametrize("name", [*COMMANDS, *GROUPS])
def test_a_command_registered_alone_has_the_help_it_has_among_all(name):
    alone, among_all = _help_pages(build_app([name]), name), _help_pages(build_app(), name)
    assert alone == among_all
    assert all(page.startswith(f"Usage: pagelab {name}") for page in alone), alone[0][:200]


def test_the_full_app_lists_every_registered_name():
    page = _help(build_app())
    for name in [*COMMANDS, *GROUPS]:
        assert f"\n  {name} " in page or f"\n  {name}\n" in page, name


def test_running_a_command_imports_no_other_command_module():
    # `main` exits; what it loaded is printed on the way out.
    code = ("import atexit, sys; from cli.commands import COMMANDS, GROUPS, main; "
            "mods = {m for m, _ in {**COMMANDS, **GROUPS}.values()}; "
            "atexit.register(lambda: print(sorted(mods & set(sys.modules)))); "
            "sys.argv = ['pagelab', 'presets']; main()")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['cli.presets']"
