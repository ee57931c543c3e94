"""How `pagelab bench` prints its results: the attention table, and benchmark rows as tables that fit
the console (fields as columns, or as rows when that is too wide) or as JSON."""
from __future__ import annotations

import json

from rich import box
from rich.table import Table

from cli.common import console

_SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def print_attention(result, on_gpu: bool) -> None:
    """The machine line, the table of records and what the columns mean."""
    machine = result.machine
    dtypes = sorted({_SHORT_DTYPES.get(r.dtype, r.dtype) for r in result.records})
    console.print(f"decode attention, {'/'.join(dtypes)}, on {machine['name']} ({machine['device']}, torch "
                  f"{machine['torch']}, {machine['threads']} threads); measured copy bandwidth "
                  f"{machine['copy_gb_per_s']} GB/s")
    console.print(attention_table(result.records))
    console.print("GB/s: K+V read + q + out per call / median time; %copy: of the measured copy bandwidth; "
                  "xSDPA: time / contiguous SDPA; err: ||out - SDPA|| / ||SDPA||.")
    if not on_gpu:
        console.print("No CUDA device: Triton rows are skipped (the interpreter only checks correctness).")


def _short(value: float) -> str:
    """Four significant digits, or a whole number with separators from 1,000 up (no exponent)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def attention_table(records) -> Table:
    """One row per implementation and shape; numbers to four significant digits, so it fits 80 columns."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name in ("impl", "B", "ctx", "Hq:Hkv*D", "ms", "GB/s", "%copy", "xSDPA", "err"):
        table.add_column(name, justify="left" if name == "impl" else "right", no_wrap=True)
    for r in records:
        table.add_row(
            r.impl.removeprefix("paged-"), str(r.batch), str(r.context),
            f"{r.num_heads}:{r.num_kv_heads}*{r.head_dim}", _short(r.time_ms), _short(r.gb_per_s),
            f"{100 * r.copy_bw_fraction:.0f}" if r.copy_bw_fraction is not None else "-",
            f"{r.vs_sdpa:.3g}" if r.vs_sdpa is not None else "-",
            f"{r.rel_err_vs_sdpa:.1e}" if r.rel_err_vs_sdpa is not None else "-",
        )
    return table


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _fits(table: Table) -> bool:
    """Whether the table's natural width fits the console (so no cell is cut or folded)."""
    from rich.measure import Measurement

    unlimited = console.options.update_width(10**6)  # measured at the console's width, it would always fit
    return Measurement.get(console, unlimited, table).maximum <= console.width


def emit(rows: list[dict], title: str, as_json: bool) -> None:
    """Print benchmark rows as a table (fields as columns), or, when that is wider than the console,
    as tables with the fields as rows and as many results side by side as fit; as JSON for machines."""
    if as_json:
        console.print_json(json.dumps(rows))
        return
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for key in rows[0]:
        table.add_column(key.replace("_", " "), justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*(_cell(v) for v in row.values()))
    if _fits(table):
        console.print(table)
        return
    per_table = len(rows)
    while per_table > 1:
        if _fits(_fields_as_rows(rows[:per_table], title, 0)):
            break
        per_table -= 1
    for start in range(0, len(rows), per_table):
        console.print(_fields_as_rows(rows[start:start + per_table], title, start))


def _fields_as_rows(rows: list[dict], title: str, first: int) -> Table:
    """One row per field, one column per result (numbered from `first` + 1)."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("result", no_wrap=True)
    for i in range(len(rows)):
        table.add_column(f"#{first + i + 1}", justify="right", no_wrap=True)
    for key in rows[0]:
        table.add_row(key.replace("_", " "), *(_cell(row.get(key)) for row in rows))
    return table
