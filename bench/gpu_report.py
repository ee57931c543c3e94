"""The GPU check's verdicts against the targets, its Markdown table and the CPU commands that follow it.

Targets (the GPU issue's): decode step p50 <= 3 ms at batch 64 (llama-1b-shape, bf16, graphs) and within
1.5x of the step's weights+KV read time; B16x1k <= 1.5x SDPA, B64x1k <= 1.2x, the 32k shapes at >= 90 % of
the copy bandwidth; sliding-window decode <= 1.1x full attention's time at the same blocks read;
contiguous-max replay wall <= 1.5x paged; azure-code held-out with no stalls (its e2e
error <= 10 % is judged on a CPU afterwards); in the memory-bound replay paged runs a larger mean batch and
a higher throughput than every contiguous policy; the engine >= 10x transformers; the CPU KV tier's load
time within 10 % of the latency model's; no GPU test failing.
"""
from __future__ import annotations

from pathlib import Path

TARGETS = {"decode_p50_ms": 3.0, "over_read_floor": 1.5, "xsdpa": {"B16x1k": 1.5, "B64x1k": 1.2},
           "copy_fraction": 0.9, "contiguous_wall_ratio": 1.5, "speedup": 10.0, "window_ratio": 1.1,
           "tier_load_error": 0.1}


def _verdict(ok: bool | None, dry: bool) -> str:
    if dry:
        return "not judged (dry run)"
    return "-" if ok is None else ("met" if ok else "NOT met")


def verdicts(report: dict) -> list[dict]:
    """One row per measurement: part, what, value, target, verdict."""
    dry, rows = report["dry_run"], []

    def row(part, what, value, target="-", ok=None):
        verdict = _verdict(ok, dry) if target != "-" else "-"
        rows.append({"part": part, "what": what, "value": value, "target": target, "verdict": verdict})

    for name, entry in report["parts"].items():
        if entry["status"] != "ok":
            row(name, entry["status"], entry.get("reason") or entry.get("error", ""))
            continue
        r = entry["result"]
        if name == "tests":
            if r.get("timed_out"):
                counts = ", ".join(f"{r.get(k, 0)} {k}" for k in ("passed", "failed", "errors", "skipped"))
                failed = "; failed: " + ", ".join(r["failed_tests"]) if r.get("failed_tests") else ""
                row(name, "pytest -m gpu", f"timed out after {r['timeout_s']:.0f} s ({counts} by then"
                    f"{failed})", "0 failed", False)
            else:
                counts = ", ".join(f"{r.get(k, 0)} {k}" for k in ("passed", "failed", "errors", "skipped"))
                row(name, "pytest -m gpu", counts, "0 failed",
                    r.get("failed", 0) + r.get("errors", 0) == 0 and r.get("returncode") in (0, 5))
        elif name == "attention":
            _attention_rows(row, r)
        elif name == "window_attention":
            _window_rows(row, r)
        elif name == "decode":
            _decode_rows(row, r)
        elif name == "decode_profile":
            kernels = "; ".join(f"{k['name'][:40]} {k['ms_per_step']:.3f}" for k in r["kernels"][:3])
            kernel_ms = "-" if r["kernel_ms_per_step"] is None else f"{r['kernel_ms_per_step']:.2f}"
            row(name, f"steady decode step, {r['num_seqs']} sequences (graphs: {r['cuda_graphs']})",
                f"wall p50 {r['wall_p50_ms']:.2f} ms, kernels {kernel_ms} ms, outside the forward call "
                f"{r['host_outside_forward_p50_ms']:.2f} ms; top kernels (ms/step): {kernels or '-'}")
        elif name == "memory_bound":
            _bound_rows(row, r)
        elif name == "contiguous_vs_paged":
            a, limit = r["allocators"], TARGETS["contiguous_wall_ratio"]
            row(name, f"contiguous-max wall / paged wall (max_num_seqs {r['max_num_seqs']})",
                f"{r['wall_ratio']:.2f}x ({a['contiguous-max']['wall_s']:.1f} s / "
                f"{a['paged']['wall_s']:.1f} s)",
                f"<= {limit}x", r["wall_ratio"] <= limit)
        elif name == "calibration":
            _calibration_rows(row, r)
        elif name == "kv_tier_copy":
            limit = TARGETS["tier_load_error"]
            row(name, f"CPU tier load of {r['blocks']} blocks ({r['mib']:.0f} MiB) / model load_time",
                f"{r['ratio']:.2f}x ({1e3 * r['measured_s']:.2f} ms vs {1e3 * r['model_s']:.2f} ms, "
                f"{r['gb_per_s']:.1f} GB/s; one plain copy {r['one_copy_gb_per_s']:.1f} GB/s)",
                f"within {100 * limit:.0f} %", abs(r["ratio"] - 1) <= limit)
        elif name == "engine_vs_transformers":
            hf = r["transformers"]
            row(name, f"engine vs transformers ({r['requests']} requests)",
                f"{r['speedup']:.1f}x ({r['engine']['tokens_per_s']:.0f} vs {hf['tokens_per_s']:.0f} tok/s; "
                f"transformers ran {hf['requests']} requests)", f">= {TARGETS['speedup']:.0f}x",
                r["speedup"] is not None and r["speedup"] >= TARGETS["speedup"])
    return rows


def _attention_rows(row, r: dict) -> None:
    for shape in r["shapes"]:
        recs = {rec["impl"]: rec for rec in shape["records"]}
        sdpa = recs.get("sdpa-dense")
        for impl in ("paged-triton", "region-triton", "paged-torch"):
            rec = recs.get(impl)
            if rec is None:
                continue
            label = shape["shape"]
            limit = TARGETS["xsdpa"].get(label) if impl == "paged-triton" else None
            big = shape["context"] >= 32768 and impl.endswith("triton")
            value = f"{rec['time_ms']:.3f} ms"
            if sdpa:
                value += (f", {rec['vs_sdpa']:.2f}x SDPA ({sdpa['time_ms']:.3f} ms), "
                          f"{100 * rec['copy_bw_fraction']:.0f}% of copy bw")
            if limit is not None:
                row("attention", f"{label} {impl}", value, f"<= {limit}x SDPA", rec["vs_sdpa"] <= limit)
            elif big:
                frac = TARGETS["copy_fraction"]
                row("attention", f"{label} {impl}", value, f">= {100 * frac:.0f}% copy bw",
                    rec["copy_bw_fraction"] >= frac)
            else:
                row("attention", f"{label} {impl}", value)
    row("attention", "copy bandwidth (read + write)", f"{r['copy_gb_per_s']} GB/s")


def _window_rows(row, r: dict) -> None:
    limit = TARGETS["window_ratio"]
    for s in r["rows"]:
        label = f"B{s['batch']} {s['blocks_read']} blocks of {s['block_size']}"
        row("window_attention", f"{label}: sliding / full", f"{s['ratio']:.2f}x ({s['sliding_ms']:.3f} ms / "
            f"{s['full_ms']:.3f} ms)", f"<= {limit}x", s["ratio"] <= limit)


def _decode_rows(row, r: dict) -> None:
    for name, d in r.items():
        if not isinstance(d, dict):
            continue
        if "skipped" in d or not d.get("num_steps"):
            row("decode", f"decode p50, {name}", d.get("skipped", f"no decode steps ({d.get('rule')})"))
            continue
        ctx = d["sum_context_p10_p50_p90"]
        headline = name == "b64-graphs"
        row("decode", f"decode p50, {name} ({d['num_steps']} steps of {d['rule']})",
            f"{d['p50_ms']:.2f} ms (p90 {d['p90_ms']:.2f}); context per step p10/p50/p90 "
            f"{ctx[0]:.0f}/{ctx[1]:.0f}/{ctx[2]:.0f} tokens, {d['context_per_seq_p50']:.0f} per sequence",
            f"<= {TARGETS['decode_p50_ms']} ms" if headline else "-",
            d["p50_ms"] <= TARGETS["decode_p50_ms"] if headline else None)
        row("decode", f"{name}: p50 / weights+KV read time",
            f"{d['over_read_floor']:.2f}x (read floor {d['read_floor_ms']:.2f} ms at "
            f"{d['copy_gb_per_s']} GB/s)",
            f"<= {TARGETS['over_read_floor']}x" if headline else "-",
            d["over_read_floor"] <= TARGETS["over_read_floor"] if headline else None)


def _bound_rows(row, r: dict) -> None:
    allocs = r["allocators"]
    for name, a in allocs.items():
        mem = a["memory"] or {}
        shares = ", ".join(f"{k.replace('_', ' ')} {100 * v:.0f}%" for k, v in mem.items() if v)
        ttft = "-" if a["ttft_p50_s"] is None else f"{a['ttft_p50_s']:.2f} s"
        tpot = "-" if a["tpot_p50_s"] is None else f"{1e3 * a['tpot_p50_s']:.1f} ms"
        row("memory_bound", f"{name} ({r['kv_memory_gb']} GiB KV)",
            f"{a['throughput_tok_s']:.0f} tok/s, mean batch {a['mean_batch']:.1f}, TTFT p50 {ttft}, TPOT p50 "
            f"{tpot}, {a['num_preemptions']} preemptions; {shares}")
    paged = allocs.get("paged")
    others = [a for n, a in allocs.items() if n != "paged"]
    if paged and others:
        ok = all(paged["mean_batch"] > a["mean_batch"] and paged["throughput_tok_s"] > a["throughput_tok_s"]
                 for a in others)
        row("memory_bound", "paged: larger mean batch and throughput than every contiguous policy",
            "yes" if ok else "no", "both larger", ok)


def _calibration_rows(row, r: dict) -> None:
    if r["profile"] is None:
        row("calibration", "profile", r["profile_note"])
    for part, p in r["parts"].items():
        if "skipped" in p:
            row("calibration", f"held-out {part}", p["skipped"])
            continue
        s = p.get("stalls")
        if s is None:
            row("calibration", f"held-out {part}", f"replayed in {p['seconds']:.0f} s; stalls not judged")
            continue
        row("calibration", f"held-out {part}: stalls against {r['profile']}",
            f"{s['count']} stalls ({s['excess_s']:.2f} s over their price, "
            f"{100 * (s['busy_share'] or 0):.1f}% of {s['busy_s']:.1f} s busy); step median |err| "
            f"{100 * s['step_median_abs_rel_error']:.1f}%",
            "no stalls" if part == "code" else "-", s["count"] == 0 if part == "code" else None)


def next_steps(report: dict, runs: Path) -> list[str]:
    """The commands that finish the check on a CPU, from the unpacked run folders."""
    base = f"runs/{runs.name}"
    steps = [f"tar xzf gpu-check-runs.tar.gz -C runs/    # the run folders, as {base}/"]
    cal = report["parts"].get("calibration", {})
    if cal.get("status") == "ok":
        r = cal["result"]
        done = [p for p, v in r["parts"].items() if "skipped" not in v]
        if done and r["profile"]:
            profile = r["profile"] if not Path(r["profile"]).is_absolute() else Path(r["profile"]).name
            steps.append(f"python -m bench.calibration --device {r['setup']['device']} --reuse --parts "
                         f"{','.join(done)} --profile {profile} --out {base}/validate    # e2e, throughput")
    if report["parts"].get("memory_bound", {}).get("status") == "ok":
        steps.append(f"pagelab plot {base}/memory-bound --out {base}/memory-bound/figures")
    return steps


def markdown(report: dict) -> str:
    """The device, then one table of every measurement against its target, then what follows on a CPU."""
    d = report["device"]
    memory = f"{d['memory_gib']} GiB, " if d.get("memory_gib") else ""
    head = (f"GPU check on **{d['name']}** ({memory}driver {d.get('driver') or '-'}, CUDA "
            f"{d.get('cuda_runtime') or '-'}, torch {d['torch']}, Triton {d.get('triton') or '-'}), "
            f"{report['started']}, commit {report.get('commit') or 'unknown'}"
            + (", **dry run** (toy sizes on a CPU)" if report["dry_run"] else "")
            + f"; {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget.")
    lines = [head, "", "| part | measurement | value | target | verdict |", "|---|---|---|---|---|"]
    for r in report["verdicts"]:
        cells = [str(r[k]).replace("|", "\\|") for k in ("part", "what", "value", "target", "verdict")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Afterwards, on a CPU, from the copied files:", ""]
    lines += [f"    {s}" for s in report["next"]]
    return "\n".join(lines) + "\n"
