"""Help pages: options in named panels with their choices and defaults, nothing cut at 80 columns."""
from __future__ import annotations

import re

import pytest
import typer
from clirun import pagelab

from cli.commands import app
from cli.help import OPTIONS_PANEL, first_paragraph, option_name, panels, render

SIMULATE_PANELS = ["Trace", "Model and pool", "Scheduler and timing", "Output", "vLLM compatibility"]


def _command(*path: str):
    """The click command at `pagelab PATH...`, with a context to ask it for its help."""
    group = typer.main.get_command(app)
    ctx = group.make_context("pagelab", list(path) + ["--help"], resilient_parsing=True)
    command = group
    for name in path:
        command = command.get_command(ctx, name)
        ctx = command.make_context(name, ["--help"], parent=ctx, resilient_parsing=True)
    return command, ctx


def _panel_titles(text: str) -> list[str]:
    """Panel titles of a help page: box titles on a terminal, `Title:` lines when piped."""
    return re.findall(r"^╭─ (.+?) ─", text, re.M) or re.findall(r"^(\S[^\n:]*):$", text, re.M)


def _flat(page: str) -> str:
    """The help page as one line of words: panel borders out, wrapped descriptions joined."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", page).split())


def test_on_a_terminal_each_panel_is_a_box():
    command, ctx = _command("simulate")
    boxed, plain = render(command, ctx, boxed=True), render(command, ctx, boxed=False)
    assert _panel_titles(boxed) == _panel_titles(plain) == SIMULATE_PANELS
    assert boxed.count("╭─") == len(SIMULATE_PANELS) and "╭" not in plain
    names = [name for rows in panels(command, ctx).values() for name, _ in rows]
    for page in (_flat(boxed), _flat(plain)):  # every option in both, in the same order
        positions = [page.index(name) for name in names]
        assert positions == sorted(positions)


def test_every_simulate_option_sits_in_a_named_panel():
    command, ctx = _command("simulate")
    grouped = panels(command, ctx)
    assert list(grouped) == SIMULATE_PANELS and OPTIONS_PANEL not in grouped
    listed = [name for rows in grouped.values() for name, _ in rows]
    # Every parameter (argument, option, -h) is listed once, under its panel.
    opts = [p for p in command.get_params(ctx)]
    assert len(listed) == len(opts)
    page = pagelab("simulate", "-h", COLUMNS="80").stdout
    assert _panel_titles(page) == SIMULATE_PANELS
    flat = _flat(page)
    for param in opts:
        assert option_name(param) in flat, param.opts


def test_choices_and_defaults_are_shown():
    page = _flat(pagelab("simulate", "-h", COLUMNS="80").stdout)
    for shown in ("--preemption recompute|swap", "--mode fast|step", "--table-format parquet|csv",
                  "choices: auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2; default: auto",
                  "--gpu-memory-utilization FLOAT", "[default: 0.9]", "--[no-]prefix-caching",
                  "(default: max(max-model-len, 2048) + max-num-seqs; 512 with chunked prefill)",
                  "(default: gpu-memory-utilization x GPU memory - weights - 1 GiB)",
                  "Step-time model: roofline, or the path of a fitted profile (JSON). [default: roofline]"):
        assert shown in page, shown


@pytest.mark.parametrize("argv", [("-h",), ("simulate", "-h"), ("replay", "-h"), ("sweep", "-h"),
                                  ("plot", "-h"), ("compare", "-h"), ("trace", "-h"), ("trace", "gen", "-h"),
                                  ("bench", "-h"), ("bench", "attention", "-h")])
def test_help_fits_80_columns_and_cuts_nothing(argv):
    result = pagelab(*argv, COLUMNS="80")
    assert result.returncode == 0, result.stderr
    assert max(map(len, result.stdout.splitlines())) <= 80 and "…" not in result.stdout


def test_the_command_list_gives_each_description_whole():
    page = _flat(pagelab("-h", COLUMNS="80").stdout)
    group, ctx = _command()
    for name in group.list_commands(ctx):
        description = first_paragraph(group.get_command(ctx, name).help)
        assert description.endswith(".") and f"{name} {description}" in page, name


def test_a_narrow_terminal_puts_descriptions_under_the_names():
    page = pagelab("simulate", "-h", COLUMNS="50").stdout
    assert max(map(len, page.splitlines())) <= 50 and "…" not in page
    assert "--max-num-batched-tokens INT" in page


def test_a_refused_choice_names_the_option_and_the_choices(tmp_path):
    result = pagelab("simulate", "--limit", "5", "--preemption", "swapp", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: Invalid value for '--preemption': 'swapp' is not one of "
                                            "'recompute', 'swap'.")


def _all_commands(command, ctx, path=()):
    """Every leaf command under `command`, with its path and a context."""
    if not isinstance(command, typer.core.TyperGroup):
        yield path, command
        return
    for name in command.list_commands(ctx):
        sub = command.get_command(ctx, name)
        yield from _all_commands(sub, sub.make_context(name, ["--help"], parent=ctx, resilient_parsing=True),
                                 (*path, name))


def test_max_num_seqs_counts_requests_in_every_command():
    """The scheduler caps running sequence groups: n samples or a beam of one request count once."""
    group, ctx = _command()
    helps = {path: p.help for path, command in _all_commands(group, ctx) for p in command.params
             if p.name == "max_num_seqs"}
    assert {("simulate",), ("replay",), ("sweep",)} <= set(helps)
    assert set(helps.values()) == {"Most requests running at once."}, helps
