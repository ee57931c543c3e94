"""Result JSON in the shape of `vllm bench serve --save-result`: one flat object per allocator.

vLLM's keys (date, backend, model_id, tokenizer_id, num_prompts, request_rate, burstiness,
max_concurrency, duration, completed, failed, token counts, throughputs, request_goodput and
mean/median/std/pNN of ttft_ms, tpot_ms, itl_ms, e2el_ms) come first, with vLLM's meanings; pagelab's
own fields (allocator, the KV pool, the memory breakdown, rejections) follow under names vLLM does not use.
`--save-result` writes one file per allocator, `--json` prints the same objects to stdout, one per line.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rich.markup import escape

from cli.common import UserError, err_console
from pagelab.atomic import atomic_write_bytes
from pagelab.run_folder import clean_json, run_metadata, versions
from simulator.metrics import METRICS

STATS = ("mean", "median", "std")  # then the percentiles, as p99


def _rate(info: dict):
    """vLLM's request_rate: the re-timed rate ("inf" for all at once), else the trace's own mean rate."""
    override = info.get("rate_override")
    if override is not None:
        return override
    rate = info.get("mean_rate_per_s")
    return "inf" if rate is None or not math.isfinite(rate) else rate


def vllm_result(command: str, name: str, metrics: dict, summary: dict, info: dict, labels: dict,
                percentiles, date: str) -> dict:
    """One allocator's result: vLLM's keys with vLLM's meanings, then pagelab's own.

    `metrics`: bench_metrics of the run (all four latency metrics); `labels`: model_id, model, gpu,
    max_concurrency, kv_cache (the KVCapacity dict) and goodput limits as the command resolved them.
    """
    model_id = labels.get("model_id") or summary.get("model")
    out = {
        "date": date, "endpoint_type": f"pagelab-{command}", "backend": f"pagelab-{command}", "label": name,
        "model_id": model_id, "tokenizer_id": model_id, "num_prompts": info.get("num_requests"),
        "request_rate": _rate(info),
        "burstiness": info.get("burstiness"),  # None: the trace's own gaps, scaled or not
        "max_concurrency": labels.get("max_concurrency"),
        "duration": metrics["duration_s"], "completed": metrics["completed"], "failed": metrics["rejected"],
        "total_input_tokens": metrics["total_input_tokens"],
        "total_output_tokens": metrics["total_output_tokens"],
        "request_throughput": metrics["request_throughput"],
        "request_goodput": metrics.get("request_goodput"),
        "output_throughput": metrics["output_throughput"],
        "total_token_throughput": metrics["total_token_throughput"],
        "max_output_tokens_per_s": metrics.get("max_output_tokens_per_s"),
        "max_concurrent_requests": metrics.get("max_concurrent_requests"),
    }
    keys = [*STATS, *(f"p{q:g}" for q in percentiles)]
    for metric in METRICS:
        for stat in keys:
            out[f"{stat}_{metric}_ms"] = metrics.get(f"{stat}_{metric}_ms")
    out.update({
        "allocator": name, "model": labels.get("model"), "gpu": labels.get("gpu"),
        "trace": info.get("source"),
        "num_rejected": metrics["rejected"], "goodput_slos_ms": metrics.get("goodput_slos_ms"),
        "kv_cache": labels.get("kv_cache"), "memory": summary.get("memory"),
        "mean_batch_size": summary.get("mean_batch_size"), "num_preemptions": summary.get("num_preemptions"),
        "prefix_cache_hit_rate": summary.get("prefix_cache_hit_rate"),
        "pagelab_version": versions()["pagelab"], "argv": run_metadata(command)["argv"],
    })
    return clean_json(out)


def result_paths(command: str, names: list[str], result_dir: Path | None, filename: str | None,
                 date: str) -> dict[str, Path]:
    """Where each allocator's result goes: FILENAME for one allocator, FILENAME-ALLOCATOR.json for more."""
    folder = Path(result_dir or ".")
    stem = f"pagelab-{command}-{date}"
    if filename is not None:
        if len(names) == 1:
            return {names[0]: folder / filename}
        stem = filename.removesuffix(".json")
    return {n: folder / (f"{stem}.json" if len(names) == 1 and filename is None else f"{stem}-{n}.json")
            for n in names}


def save_results(results: dict[str, dict], paths: dict[str, Path]) -> None:
    """Write each allocator's result JSON atomically (vLLM's --save-result); none when one is a folder."""
    for path in paths.values():
        if path.is_dir():
            raise UserError(f"--result-filename {path.name}: {path} is a folder")
    for name, path in paths.items():
        try:
            atomic_write_bytes(path, (json.dumps(results[name], indent=2) + "\n").encode())
        except OSError as exc:
            raise UserError(f"cannot write the result {path}: {exc.strerror or exc}") from None
        err_console.print(f"saved result {escape(str(path))}", emoji=False)


def print_json_lines(results: dict[str, dict]) -> None:
    """`--json`: one result object per line on stdout."""
    for result in results.values():
        print(json.dumps(result), flush=True)


def now_stamp() -> str:
    """vLLM's date format."""
    return time.strftime("%Y%m%d-%H%M%S")
