"""`pagelab trace reuse`: how much of a trace's prompts a prefix cache of a given size would find."""
from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from cli.common import UserError, console, err_console, names_list, plot_format, printing_warnings

MAX_CAPACITY = 1e15  # tokens: far past any cache, and block counts stay exact in int64 and float64


def _tokens(values: list[str] | None) -> list[int]:
    """Parse --capacity 100000,1e6,... (repeated and/or comma-separated) into whole token counts."""
    out = []
    for part in names_list(values):
        try:
            value = float(part)
        except ValueError:
            raise UserError(f"--capacity expects token counts separated by commas, e.g. 1e5,1e6 "
                            f"(got {part!r})") from None
        if not (1 <= value <= MAX_CAPACITY and value == int(value)):
            raise UserError(f"--capacity expects whole token counts from 1 to {MAX_CAPACITY:.0e} "
                            f"(got {part!r})")
        out.append(int(value))
    return out


def _table(name: str, report: dict, policies: list[str]) -> Table:
    """The rich table printed by `trace reuse`."""
    table = Table(title=f"prefix reuse of {escape(name)} (block size {report['block_size']})",
                  header_style="bold")
    table.add_column("capacity (tokens)", justify="right")
    for p in policies:
        table.add_column(f"{p} hit ratio", justify="right")
    for row in report["capacities"]:
        table.add_row(f"{row['capacity_tokens']:,}", *(f"{row[p]['hit_ratio']:.3f}" for p in policies))
    inf = report["infinite"]
    table.add_row("infinite", *(f"{inf['hit_ratio']:.3f}" for _ in policies))
    dist = report["reuse_distance_tokens"]
    caption = (f"{report['num_requests']:,} requests, {report['queried_blocks']:,} prefix blocks looked up, "
               f"{report['unique_blocks']:,} unique; reuse distance p50/p90/p99 "
               + "/".join("-" if v is None else f"{v:,.0f}" for v in dist.values()) + " tokens")
    rec = report["recorded"]
    if rec:
        caption += (f"\nrecorded keys ({rec['block_size']} tokens): {rec['references']:,} references, "
                    f"{rec['unique_blocks']:,} unique, {100 * rec['repeat_fraction']:.1f}% repeats")
    table.caption = caption
    return table


def reuse_cmd(
    path: str = typer.Argument(..., metavar="TRACE", help="Trace file or bundled name (mooncake-conv, ...)."),
    capacity: list[str] = typer.Option(None, "--capacity", help="Cache capacities in tokens, comma-separated "
                                                                "or repeated (e.g. 1e5,1e6,1e7)."),
    policy: list[str] = typer.Option(None, "--policy", help="Eviction policies, comma-separated or repeated: "
                                                            "lru (default), lfu, s3fifo (lfu and s3fifo are "
                                                            "simulated per capacity)."),
    block_size: int = typer.Option(16, "--block-size", help="The simulator's block size in tokens."),
    format: str = typer.Option("auto", "--input-format", "--format", help="Input format (auto by default)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    plot: Path = typer.Option(None, "--plot", help="Save the hit-ratio-versus-capacity curve "
                                                   "(.png, .svg or .pdf)."),
) -> None:
    """Show the prefix-block reuse of a trace and the hit ratio a prefix cache reaches at each capacity."""
    from pagelab.eviction import POLICIES
    from traces.reuse import load_refs
    from traces.reuse_report import reuse_report

    policies = names_list(policy) if policy else ["lru"]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise UserError(f"--policy expects names from {', '.join(POLICIES)} (got "
                        f"{', '.join(map(repr, bad or policy))})")
    if block_size < 1:
        raise UserError(f"--block-size must be >= 1 (got {block_size})")
    capacities = _tokens(capacity)
    if plot is not None:
        from cli.runs import check_out_file

        plot_format(plot)
        check_out_file(plot, f"--plot {plot}")
    with printing_warnings() as warnings:
        refs, recorded = load_refs(path, block_size, format, warnings=warnings)
    report, _ = reuse_report(refs, recorded, capacities, policies)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        console.print(_table(path, report, policies))
    if plot is not None:
        from viz.reuse_curve import save_reuse_curve

        written = save_reuse_curve(report, plot, title=f"Prefix reuse of {Path(path).name}")
        err_console.print(f"wrote {escape(str(written))}", highlight=False)
