"""`pagelab trace gen | info | convert`: make, inspect and convert request traces."""
from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from cli.common import (
    UserError,
    check_seed,
    console,
    err_console,
    pick_one,
    plot_format,
    printing_warnings,
    user_errors,
    warn,
)

trace_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="Generate, inspect and convert request traces.")

_NAMED_LENGTHS = ("fixed", "uniform", "sharegpt", "alpaca")
MAX_GENERATED = 10**8  # ~10 GB of intermediate arrays; larger traces are better made in pieces


def _range(text: str, option: str) -> tuple[int, int]:
    """Parse LO:HI into two ints."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"{option} expects LO:HI with whole numbers, e.g. 1:512 (got {text!r})") from None
    return lo, hi


def _shared_prefix(text: str | None) -> dict[str, object]:
    """Parse --shared-prefix k:L:f into SyntheticConfig fields."""
    if not text:
        return {}
    try:
        k, length, fraction = text.split(":")
        fields = {"num_prefix_groups": int(k), "prefix_len": int(length), "prefix_fraction": float(fraction)}
    except ValueError:
        raise UserError("--shared-prefix expects K:L:F (K system prompts of L tokens used by a fraction F "
                        f"of the requests), e.g. 4:256:0.5 (got {text!r})") from None
    if fields["num_prefix_groups"] < 1:
        raise UserError(f"--shared-prefix {text}: K, the number of system prompts, must be >= 1")
    return fields


# Options that apply only to one kind of trace, and their defaults (a default is never refused).
_SINGLE_TURN_ONLY = {"arrival": ("--arrival", None), "cv": ("--cv", None),
                     "burstiness": ("--burstiness", None), "lengths": ("--lengths", "sharegpt"),
                     "shared_prefix": ("--shared-prefix", None), "n": ("--n", 1),
                     "beam_width": ("--beam-width", 1), "prompt_len": ("--prompt-len", 128),
                     "output_len": ("--output-len", 128), "prompt_range": ("--prompt-range", "1:1024"),
                     "output_range": ("--output-range", "1:1024")}
# The --lengths distribution each length option shapes.
_LENGTHS_OF = {"prompt_len": "fixed", "output_len": "fixed", "prompt_range": "uniform",
               "output_range": "uniform"}
_MULTI_TURN_ONLY = {"turns": ("--turns", 1.55), "think_time": ("--think-time", 60.0),
                    "think_dist": ("--think-dist", "exponential")}
MAX_TURNS = 10_000  # mean turns per conversation; beyond it the geometric draws stop meaning anything
MAX_THINK_S = 1e9  # about 30 years between turns


# Generator settings whose option is not the field's name with dashes.
_OPTION_OF_FIELD = {"num_requests": "--num", "rate": "--request-rate", "lengths_from": "--lengths",
                    "num_prefix_groups": "--shared-prefix", "prefix_len": "--shared-prefix",
                    "prefix_fraction": "--shared-prefix", "mean_turns": "--turns",
                    "think_time_s": "--think-time", "think_time": "--think-dist"}


def _make_config(cls, **fields):
    """`cls(**fields)`, a refused setting reported by the option that gave it."""
    from traces.errors import TraceFieldError

    try:
        return cls(**fields)
    except TraceFieldError as e:
        option = _OPTION_OF_FIELD.get(e.field, "--" + e.field.replace("_", "-"))
        raise UserError(f"{option}: {e.problem} (got {e.value!r})") from None


def _refuse_unused(multi_turn: bool, **given) -> None:
    """Refuse options the chosen kind of trace would silently ignore, naming them."""
    other = _SINGLE_TURN_ONLY if multi_turn else _MULTI_TURN_ONLY
    unused = [flag for name, (flag, default) in other.items() if given[name] != default]
    if unused:
        verb = "does" if len(unused) == 1 else "do"
        raise UserError(f"{', '.join(unused)} {verb} not apply "
                        f"{'with --multi-turn' if multi_turn else 'without --multi-turn'}")
    for name, kind in _LENGTHS_OF.items():
        flag, default = _SINGLE_TURN_ONLY[name]
        if given[name] != default and given["lengths"] != kind:
            raise UserError(f"{flag} applies only with --lengths {kind} (got --lengths {given['lengths']})")
    arrival = given["arrival"]  # None: not given (Poisson)
    if not multi_turn and given["cv"] is not None and arrival != "gamma":
        raise UserError(f"--cv shapes gamma arrivals: it needs --arrival gamma "
                        f"(got --arrival {arrival or 'poisson'})")
    if given["burstiness"] is not None and arrival not in (None, "gamma"):
        raise UserError(f"--burstiness makes gamma arrivals: it does not apply with --arrival {arrival}")
    rate = given["rate"]
    if arrival == "burst" and rate is not None:
        raise UserError("--request-rate does not apply with --arrival burst (every request at t=0)")
    if arrival not in (None, "burst") and rate is not None and math.isinf(rate):
        raise UserError(f"--request-rate inf puts every request at t=0: it does not apply with "
                        f"--arrival {arrival}")
    if not multi_turn and given["prefix_block_size"] is not None and given["shared_prefix"] is None:
        raise UserError("--prefix-block-size records shared prefixes: it needs --shared-prefix or "
                        "--multi-turn")
    turns, think = given["turns"], given["think_time"]
    if not (math.isfinite(turns) and 1 <= turns <= MAX_TURNS):
        raise UserError(f"--turns must be a finite number in [1, {MAX_TURNS:,}], got {turns}")
    if not (math.isfinite(think) and 0 <= think <= MAX_THINK_S):
        raise UserError(f"--think-time must be a finite number of seconds in [0, {MAX_THINK_S:g}], "
                        f"got {think}")
    from simulator.core.config import CacheConfig

    size, default = given["prefix_block_size"], CacheConfig.block_size
    if size is not None and size > 0 and size % default and default % size:
        warn(f"--prefix-block-size {size}: a paged run reuses these keys only at a --block-size that divides "
             f"{size} or is a multiple of it, which the default {default} is not")


@trace_app.command("gen")
@user_errors
def gen(
    out: Path = typer.Option(..., "--out", "-o", help="Output file: .csv, .jsonl or .parquet."),
    num: int = typer.Option(None, "--num", help="Number of requests (default 1000)."),
    num_prompts: int = typer.Option(None, "--num-prompts", help="Same as --num (vLLM's name)."),
    arrival: str = typer.Option(None, help="Arrival process: poisson (default), gamma or burst (all at "
                                           "t=0)."),
    rate: float = typer.Option(None, "--request-rate", "--rate",
                               help="Mean requests/s (default 1; 3.4 with --multi-turn, reached by long "
                                    "traces only); inf: all at t=0."),
    cv: float = typer.Option(None, help="Coefficient of variation of the gaps (gamma; default 1)."),
    burstiness: float = typer.Option(None, help="vLLM's gamma shape (1 Poisson, <1 burstier): gamma "
                                                "arrivals with cv = 1/sqrt(burstiness)."),
    lengths: str = typer.Option(
        "sharegpt", "--lengths", "--lengths-from",
        help="fixed, uniform, sharegpt, alpaca (synthetic stand-ins), or a trace file / bundled name "
             "whose (prompt, output) pairs are resampled."),
    prompt_len: int = typer.Option(128, help="Prompt length for --lengths fixed."),
    output_len: int = typer.Option(128, help="Output length for --lengths fixed."),
    prompt_range: str = typer.Option("1:1024", help="LO:HI prompt lengths for --lengths uniform."),
    output_range: str = typer.Option("1:1024", help="LO:HI output lengths for --lengths uniform."),
    max_model_len: int = typer.Option(None, help="prompt + output never exceed this (default 2048; "
                                                 "131072 with --multi-turn)."),
    shared_prefix: str = typer.Option(None, help="K:L:F: K system prompts of L tokens, each request "
                                                 "uses one with probability F."),
    prefix_block_size: int = typer.Option(None, help="Block size the prefix keys are recorded at (default "
                                                     "16; 512 with --multi-turn)."),
    multi_turn: bool = typer.Option(False, "--multi-turn", help="Conversations: each turn's prompt extends "
                                    "the last prompt plus answer (defaults match the Mooncake conversation "
                                    "trace; no --lengths, --shared-prefix)."),
    turns: float = typer.Option(1.55, "--turns", help="--multi-turn: mean turns per conversation "
                                                       "(geometric)."),
    think_time: float = typer.Option(60.0, "--think-time", help="--multi-turn: mean seconds from a turn's "
                                                                "arrival to the next turn's."),
    think_dist: str = typer.Option("exponential", "--think-dist", help="--multi-turn: exponential, "
                                                                      "lognormal (cv 1) or fixed."),
    n: int = typer.Option(1, "--n", help="Parallel samples per request."),
    beam_width: int = typer.Option(1, help="Beam width per request."),
    seed: int = typer.Option(0, help="Random seed."),
) -> None:
    """Generate a seeded synthetic trace."""
    from traces import SyntheticConfig, generate_trace, save_trace
    from traces.stats import trace_info

    check_seed(seed)
    from cli.runs import check_out_file

    check_out_file(out, f"--out {out}")  # a folder or a path under a file, before the trace is made
    _refuse_unused(multi_turn, arrival=arrival, cv=cv, burstiness=burstiness, lengths=lengths,
                   shared_prefix=shared_prefix, n=n, beam_width=beam_width, turns=turns,
                   think_time=think_time, think_dist=think_dist, prompt_len=prompt_len,
                   output_len=output_len, prompt_range=prompt_range, output_range=output_range, rate=rate,
                   prefix_block_size=prefix_block_size)
    arrival = arrival or "poisson"
    given_rate = rate  # None: each kind of trace has its own default rate
    rate = 1.0 if rate is None else rate
    kind = lengths if lengths in _NAMED_LENGTHS else "resample"
    if kind == "resample" and not multi_turn:
        from traces.errors import TraceError
        from traces.loaders import resolve_trace

        try:
            resolve_trace(lengths)
        except TraceError as exc:
            raise UserError(f"--lengths {lengths}: expected {', '.join(_NAMED_LENGTHS)}, or a trace to "
                            f"resample lengths from; {exc}") from None
    num = pick_one("--num/--num-prompts", num, num_prompts)
    num = 1000 if num is None else num
    if num > MAX_GENERATED:
        raise UserError(f"--num {num:,} is more requests than trace gen makes (at most {MAX_GENERATED:,})")
    if burstiness is not None:
        if cv is not None:
            raise UserError("give --burstiness or --cv, not both (cv = 1/sqrt(burstiness))")
        if not (math.isfinite(burstiness) and burstiness > 0):
            raise UserError(f"--burstiness must be a finite number > 0, got {burstiness}")
        arrival, cv = "gamma", 1 / math.sqrt(burstiness)
    if math.isnan(rate):
        raise UserError("--request-rate must be > 0 requests/s, or inf (all at t=0)")
    if math.isinf(rate) and rate > 0:
        arrival = "burst"
    from traces.schema import MAX_ARRIVAL_S

    if not multi_turn and rate > 0 and arrival != "burst" and num / rate > MAX_ARRIVAL_S:
        raise UserError(f"--request-rate {rate:g}: {num:,} requests at this rate arrive over about "
                        f"{num / rate:.3g} s, past the {MAX_ARRIVAL_S:g} s a trace's clock resolves")
    if multi_turn:
        _gen_multi_turn(out, num, given_rate, turns, think_time, think_dist, max_model_len, prefix_block_size,
                        seed)
        return
    config = _make_config(
        SyntheticConfig, num_requests=num, arrival=arrival, rate=rate, cv=1.0 if cv is None else cv,
        lengths=kind, prompt_len=prompt_len, output_len=output_len,
        prompt_range=_range(prompt_range, "--prompt-range"),
        output_range=_range(output_range, "--output-range"),
        lengths_from=None if kind != "resample" else lengths,
        max_model_len=2048 if max_model_len is None else max_model_len,
        prefix_block_size=16 if prefix_block_size is None else prefix_block_size,
        n=n, beam_width=beam_width, seed=seed,
        **_shared_prefix(shared_prefix),
    )
    with printing_warnings() as warnings:
        trace = generate_trace(config, warnings=warnings)
        save_trace(trace, out, warnings=warnings)
    info = trace_info(trace)
    console.print(f"wrote {info['num_requests']} requests to {escape(str(out))} (mean prompt "
                  f"{info['prompt_len']['mean']:.1f}, mean output {info['output_len']['mean']:.1f} tokens)",
                  highlight=False)


def _gen_multi_turn(out: Path, num: int, rate: float | None, turns: float, think_time: float,
                    think_dist: str, max_model_len: int | None, prefix_block_size: int | None,
                    seed: int) -> None:
    """`trace gen --multi-turn`: write a conversation trace."""
    from traces import save_trace
    from traces.multiturn import MultiTurnConfig, generate_multiturn
    from traces.stats import trace_info

    given = {"rate": rate, "max_model_len": max_model_len, "prefix_block_size": prefix_block_size}
    config = _make_config(MultiTurnConfig, num_requests=num, mean_turns=turns,
                          think_time_s=think_time, think_time=think_dist, seed=seed,
                          **{k: v for k, v in given.items() if v is not None})
    with printing_warnings() as warnings:
        trace = generate_multiturn(config, warnings=warnings)
        save_trace(trace, out, warnings=warnings)
    info = trace_info(trace)
    console.print(f"wrote {info['num_requests']} requests to {escape(str(out))} (mean prompt "
                  f"{info['prompt_len']['mean']:.1f}, mean output {info['output_len']['mean']:.1f} tokens, "
                  f"{100 * info['prefix']['repeat_fraction']:.1f}% of prefix blocks repeat)", highlight=False)


def _fmt(value: float | None, digits: int = 1) -> str:
    """A number for the info table."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _info_table(name: str, info: dict) -> Table:
    """The rich table printed by `trace info`."""
    table = Table(title=f"trace {escape(name)}", show_header=True, header_style="bold")
    table.add_column("")
    for col in ("mean", "p50", "p90", "p99", "max"):
        table.add_column(col, justify="right")
    for key in ("prompt_len", "output_len"):
        d = info[key]
        table.add_row(key, *(_fmt(d[c]) for c in ("mean", "p50", "p90", "p99")), _fmt(d["max"]))
    for key in ("n", "beam_width"):
        d = info[key]
        table.add_row(key, _fmt(d["mean"], 2), "", "", "", _fmt(d["max"]))
    rate = info["mean_rate_per_s"]
    table.caption = (f"{info['num_requests']:,} requests over {info['duration_s']:,.1f} s, mean rate "
                     f"{_fmt(rate, 3)} req/s, {info['total_tokens']:,} tokens")
    prefix = info["prefix"]
    if prefix:
        sizes = prefix["block_sizes"]
        size = f"{sizes[0]}" if len(sizes) == 1 else f"mixed sizes: {', '.join(map(str, sizes))}"
        table.caption += (f"\nprefix blocks ({size} tokens): {prefix['references']:,} "
                          f"references, {prefix['unique_blocks']:,} unique, "
                          f"{100 * prefix['repeat_fraction']:.1f}% repeats; "
                          f"{prefix['requests_with_prefix']:,} requests carry keys")
    return table


@trace_app.command("info")
@user_errors
def info(
    path: str = typer.Argument(..., help="Trace file or bundled name (azure-conv, azure-code, ...)."),
    format: str = typer.Option("auto", "--input-format", "--format",
                               help="Input format (auto-detected by default)."),
    as_json: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
    plot: Path = typer.Option(None, "--plot", help="Also save an overview figure (format from suffix)."),
) -> None:
    """Show count, duration, rate, length percentiles and prefix reuse of a trace."""
    from traces import load_trace
    from traces.stats import trace_info

    fmt = None if plot is None else plot_format(plot)
    if plot is not None:
        from cli.runs import check_out_file

        check_out_file(plot, f"--plot {plot}")
    with printing_warnings() as warnings:
        trace = load_trace(path, format, warnings=warnings)
    stats = trace_info(trace)
    if as_json:
        typer.echo(json.dumps(stats, indent=2))
    else:
        console.print(_info_table(path, stats))
    if plot is not None:
        from viz.common import save_figure
        from viz.trace_overview import plot_trace_overview

        # The file named, whatever its suffix (the figure format came from it, PNG without one).
        written = save_figure(plot_trace_overview(trace).figure, plot, fmt)
        err_console.print(f"wrote {escape(str(written))}", highlight=False)


@trace_app.command("convert")
@user_errors
def convert(
    src: str = typer.Argument(..., metavar="IN", help="Trace file (any supported format) or bundled name."),
    dst: Path = typer.Argument(..., metavar="OUT", help="Output file: .csv, .jsonl or .parquet."),
    format: str = typer.Option("auto", "--input-format", "--format",
                               help="Input format (auto-detected by default)."),
) -> None:
    """Convert a trace to pagelab's canonical CSV, JSONL or Parquet."""
    from cli.runs import check_out_file
    from traces import load_trace, save_trace

    check_out_file(dst, str(dst))
    with printing_warnings() as warnings:
        trace = load_trace(src, format, warnings=warnings)
        save_trace(trace, dst, warnings=warnings)
    console.print(f"converted {len(trace)} requests: {escape(src)} -> {escape(str(dst))}", highlight=False)


from cli.trace_reuse import reuse_cmd  # noqa: E402 - registered after the commands above

trace_app.command("reuse")(user_errors(reuse_cmd))
