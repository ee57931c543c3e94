"""`pagelab plan`: a model's KV cache groups and pool on a GPU, computed and worded as vLLM's start-up."""
from __future__ import annotations

import json
from typing import Literal

import typer
from rich import box
from rich.table import Table

from cli.common import console, user_errors, warn_long_context

PlanDtype = Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]


def plan_rows(capacity) -> list[dict]:
    """One row per KV cache group (one row for a model whose layers all attend fully)."""
    rows = capacity.group_rows()
    if rows and capacity.grouped:
        return rows
    layout = capacity.layout
    return [{"group": 0, "kind": layout.groups[0].spec.kind, "window": None,
             "layers": len(layout.groups[0].layers), "padding_layers": 0,
             "bytes_per_token": capacity.bytes_per_token, "block_bytes": layout.block_bytes,
             "max_blocks_per_request": capacity.blocks_per_request}]


def _table(rows: list[dict]) -> Table:
    table = Table(title="KV cache groups", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    heads = {"group": "group", "kind": "kind", "window": "window", "layers": "layers",
             "padding_layers": "padding", "bytes_per_token": "B/token", "block_bytes": "B/block",
             "max_blocks_per_request": "blocks/req"}
    for key, head in heads.items():
        table.add_column(head, justify="left" if key == "kind" else "right")
    for row in rows:
        table.add_row(*("-" if row[k] is None else f"{row[k]:,}" if isinstance(row[k], int) else str(row[k])
                        for k in heads))
    return table


@user_errors
def plan_cmd(
    model: str = typer.Option(..., help="Registry model, its Hugging Face id, or a local folder with a "
                                        "config.json; see `pagelab presets`."),
    gpu: str = typer.Option(None, help="GPU preset whose memory sizes the pool (a100-40gb, a100-80gb, "
                                       "h100-80gb, h200, cpu); not needed with --kv-memory-gb."),
    kv_cache_dtype: PlanDtype = typer.Option("auto", help="Dtype of the KV cache (auto: the model's)."),
    max_model_len: int = typer.Option(None, help="Tokens per request for the concurrency line "
                                                 "(default: the model's)."),
    kv_memory_gb: float = typer.Option(None, help="KV cache size in GiB, instead of what the GPU leaves."),
    gpu_memory_utilization: float = typer.Option(0.9, help="Share of the GPU's memory vLLM may use."),
    block_size: int = typer.Option(16, help="Tokens per block."),
    max_num_batched_tokens: int = typer.Option(
        None, help="Tokens one step computes, which bounds a sliding window's blocks per request "
                   "(default: vLLM's server default, 8192 on a GPU of 70 GiB or more but an A100, "
                   "else 2048)."),
    hybrid: bool = typer.Option(True, "--hybrid/--no-hybrid",
                                help="Group layers by attention type; --no-hybrid keeps every token on "
                                     "every layer (vLLM's --disable-hybrid-kv-cache-manager)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """KV bytes per token and per block of each KV cache group, padding layers, pool size in tokens and
    blocks, the maximum concurrency at max-model-len and whether vLLM would start, by vLLM's rules."""
    from simulator.core.errors import ConfigError
    from simulator.presets import GIB, get_gpu, kv_capacity

    if gpu is None and kv_memory_gb is None:
        raise ConfigError("plan needs --gpu or --kv-memory-gb to size the KV pool")
    if max_model_len is not None and max_model_len < 1:
        raise ConfigError(f"--max-model-len must be > 0, got {max_model_len}")
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        raise ConfigError(f"--max-num-batched-tokens must be > 0, got {max_num_batched_tokens}")
    if gpu is not None and kv_memory_gb is not None:
        memory = get_gpu(gpu).memory_bytes
        if kv_memory_gb * GIB > memory:
            raise ConfigError(f"--kv-memory-gb {kv_memory_gb:g} GiB is more than the {memory / GIB:g} GiB of "
                              f"--gpu {gpu}")
    capacity = kv_capacity(model, gpu, gpu_memory_utilization=gpu_memory_utilization,
                           kv_memory_gb=kv_memory_gb, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                           max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                           hybrid=hybrid)
    warn_long_context(capacity.model, capacity.max_model_len)
    rows = plan_rows(capacity)
    if as_json:
        out = {**capacity.to_dict(), "kv_groups": rows, "blocks_per_request": capacity.blocks_per_request,
               "max_num_batched_tokens": capacity.max_num_batched_tokens,
               "padding_layers": sum(r["padding_layers"] for r in rows)}
        typer.echo(json.dumps(out, indent=2))
        return
    for line in capacity.lines():
        console.print(line, markup=False, soft_wrap=True)
    console.print(_table(rows))
    console.print(f"A request of {capacity.max_model_len:,} tokens holds at most "
                  f"{capacity.blocks_per_request:,} blocks (steps of {capacity.max_num_batched_tokens:,} "
                  "tokens).", markup=False)
