"""Render the KV cache table of docs/hybrid.md from `kv_capacity` (simulator/presets.py).

`python docs/gen_kv_table.py` rewrites the table between the page's markers; tests/simulator/core/
test_kv_layout.py fails while the committed table differs from what `render()` returns.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "hybrid.md"
BEGIN, END = "<!-- kv table begin -->", "<!-- kv table end -->"
MODELS = ("llama-3.1-8b", "mistral-7b-v0.1", "qwen3-32b", "gemma-3-27b", "gpt-oss-20b", "gpt-oss-120b",
          "deepseek-v3")
KV_GIB, STEP = 40, 8192  # the same KV memory and step budget for every row


def render() -> str:
    """The table: one row per preset, its model dtype and fp8 side by side (bf16 / fp8), at 40 GiB of KV
    memory and the model's max length."""
    from simulator.presets import kv_capacity

    rows = ["| model | groups | padding | KiB/token | pool tokens | blocks | max len | concurrency |",
            "|---|---|--:|--:|--:|--:|--:|--:|"]
    for name in MODELS:
        caps = [kv_capacity(name, kv_memory_gb=KV_GIB, kv_cache_dtype=dtype, max_num_batched_tokens=STEP)
                for dtype in ("auto", "fp8")]
        cap = caps[0]
        kinds: dict[str, int] = {}
        for g in cap.layout.groups:
            kind = g.spec.kind.replace("sliding_window", "sliding")
            label = kind + (f" {g.spec.window}" if g.spec.window else "")
            kinds[label] = kinds.get(label, 0) + 1
        groups = ", ".join(f"{n} x {k}" for k, n in kinds.items()) + f" of {cap.layout.group_size}"
        both = [" / ".join(f(c) for c in caps) for f in (
            lambda c: f"{c.bytes_per_token / 1024:g}", lambda c: f"{c.num_tokens:,}",
            lambda c: f"{c.num_blocks:,}", lambda c: f"{c.max_concurrency:.2f}x")]
        rows.append(f"| {name} | {groups} | {cap.layout.num_padding_layers} | {both[0]} | {both[1]} | "
                    f"{both[2]} | {cap.max_model_len:,} | {both[3]} |")
    return "\n".join(rows)


def replaced(text: str) -> str:
    """`text` with the table between the markers rendered anew."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render()}\n{END}{tail}"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    PAGE.write_text(replaced(PAGE.read_text()))
