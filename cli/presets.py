"""`pagelab presets`: the model registry and GPU presets with the numbers the simulator uses."""
from __future__ import annotations

import json

import typer
from rich import box
from rich.table import Table

from cli.common import console, user_errors


def preset_rows() -> dict[str, list[dict]]:
    """Every registry model and GPU preset as plain dicts (what the tables and --json show).

    Every model simulates; `replay` is the engine preset that replays it with random weights, "checkpoint"
    where the engine needs a local Hugging Face folder of it, None where the engine cannot run it.
    """
    from gpu_backend.model_config import SUPPORTED_ARCHITECTURES
    from gpu_backend.model_presets import ENGINE_PRESETS
    from simulator.core.models import MODELS
    from simulator.presets import GIB, GPUS

    def replay(m) -> str | None:
        preset = next((n for n in m.names if n in ENGINE_PRESETS), None)
        return preset or ("checkpoint" if m.architecture in SUPPORTED_ARCHITECTURES else None)

    models = [{"model": m.name, "hf_id": m.hf_id, "aliases": list(m.aliases),
               "params_b": round(m.num_params / 1e9, 2) if m.num_params else None,
               "layers": m.num_hidden_layers, "kv_heads": f"{m.num_key_value_heads}/{m.num_attention_heads}",
               "head_dim": m.head_dim, "kv_kib_per_token": m.bytes_per_token / 1024,
               "max_model_len": m.max_model_len,
               "weights_gib": round(m.weight_bytes / GIB, 1) if m.num_params else None,
               "replay": replay(m)} for m in MODELS.values()]
    gpus = [{"gpu": g.name, "memory_gib": g.memory_bytes / GIB, "hbm_tb_s": g.hbm_bandwidth / 1e12,
             "tflops_bf16": g.peak_flops / 1e12, "pcie_gb_s": g.pcie_bandwidth / 1e9} for g in GPUS.values()]
    return {"models": models, "gpus": gpus}


_HIDDEN = ("hf_id", "aliases", "replay")  # in --json; the table's footer says them in words


def _table(rows: list[dict], title: str, units: dict[str, str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    keys = [k for k in rows[0] if k not in _HIDDEN]
    for key in keys:
        table.add_column(units.get(key, key), justify="left" if key in ("model", "gpu") else "right")
    for row in rows:
        table.add_row(*(f"{row[k]:g}" if isinstance(row[k], float) else "-" if row[k] is None else str(row[k])
                        for k in keys))
    return table


def hf_line(models: list[dict]) -> str:
    """Which Hugging Face ids --model accepts, in one sentence."""
    ids = [f"{' or '.join(n for n in (r['hf_id'], *r['aliases']) if n and '/' in n)} ({r['model']})"
           for r in models if r["hf_id"]]
    return (f"simulate --model also takes these Hugging Face ids, in any case: {', '.join(ids)}; or a local "
            f"folder with a config.json (any decoder: its shape is read from it).")


def replay_line(models: list[dict]) -> str:
    """Which models the engine replays, and how, in one sentence."""
    presets = [r["replay"] + ("" if r["replay"] == r["model"] else f" (= {r['model']})")
               for r in models if r["replay"] not in (None, "checkpoint")]
    folders = [r["model"] for r in models if r["replay"] == "checkpoint"]
    neither = [r["model"] for r in models if r["replay"] is None]
    line = (f"replay --model: {', '.join(presets)} with seeded random weights, or a local Hugging Face "
            f"checkpoint folder ({', '.join(folders)})")
    return line + (f"; the engine cannot run {', '.join(neither)}." if neither else ".")


@user_errors
def presets_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables.")) -> None:
    """List the model registry and GPU presets with their numbers and what replays each model."""
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
    console.print(hf_line(rows["models"]))
    console.print(replay_line(rows["models"]))
    unknown = [r["model"] for r in rows["models"] if r["params_b"] is None]
    if unknown:  # the roofline step time and the weights' share of memory both need the parameter count
        console.print(f"params -: {', '.join(unknown)} give no parameter count (mixture-of-experts), so "
                      "simulate needs a fitted latency profile (--profile) and a pool size (--kv-memory-gb); "
                      "plan needs --kv-memory-gb.")
