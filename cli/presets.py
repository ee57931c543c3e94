"""`pagelab presets`: the model and GPU presets with the numbers the simulator uses."""
from __future__ import annotations

import json

import typer
from rich import box
from rich.table import Table

from cli.common import console, user_errors


def preset_rows() -> dict[str, list[dict]]:
    """Every simulator model and GPU preset as plain dicts (what the tables and --json show)."""
    from simulator.specs import GIB, GPUS, MODELS

    models = [{"model": m.name, "params_b": round(m.num_params / 1e9, 2), "layers": m.num_layers,
               "kv_heads": f"{m.num_kv_heads}/{m.num_heads}", "head_dim": m.head_dim,
               "kv_kib_per_token": m.bytes_per_token / 1024, "max_model_len": m.max_model_len,
               "weights_gib": round(m.weight_bytes / GIB, 1)} for m in MODELS.values()]
    gpus = [{"gpu": g.name, "memory_gib": g.memory_bytes / GIB, "hbm_tb_s": g.hbm_bandwidth / 1e12,
             "tflops_bf16": g.peak_flops / 1e12, "pcie_gb_s": g.pcie_bandwidth / 1e9} for g in GPUS.values()]
    return {"models": models, "gpus": gpus}


def _table(rows: list[dict], title: str, units: dict[str, str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    for key in rows[0]:
        table.add_column(units.get(key, key), justify="left" if key in ("model", "gpu") else "right")
    for row in rows:
        table.add_row(*(f"{v:g}" if isinstance(v, float) else str(v) for v in row.values()))
    return table


@user_errors
def presets_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables.")) -> None:
    """List the model and GPU presets (--model, --gpu of simulate) with their numbers."""
    rows = preset_rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    console.print(_table(rows["models"], "models (simulate --model)",
                         {"params_b": "params B", "kv_heads": "kv/q", "head_dim": "dim",
                          "kv_kib_per_token": "KiB/tok", "max_model_len": "max len",
                          "weights_gib": "wt GiB"}))
    console.print(_table(rows["gpus"], "GPUs (simulate --gpu)",
                         {"memory_gib": "GiB", "hbm_tb_s": "HBM TB/s", "tflops_bf16": "TFLOP/s",
                          "pcie_gb_s": "PCIe GB/s"}))
    console.print("Engine presets (replay --model): tiny, tiny-qwen2, llama-1b-shape, or a Hugging Face "
                  "folder.")
