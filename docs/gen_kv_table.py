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
    """The table: one row per preset and KV dtype, at 40 GiB of KV memory and the model's max length."""
    from simulator.presets import kv_capacity

    rows = ["| model | KV dtype | KiB/token | groups | padding | KiB/block | pool tokens | blocks | "
            "max len | concurrency |", "|---|---|--:|---|--:|--:|--:|--:|--:|--:|"]
    for name in MODELS:
        for dtype in ("auto", "fp8"):
            cap = kv_capacity(name, kv_memory_gb=KV_GIB, kv_cache_dtype=dtype, max_num_batched_tokens=STEP)
            kinds: dict[str, int] = {}
            for g in cap.layout.groups:
                label = g.spec.kind + (f" {g.spec.window}" if g.spec.window else "")
                kinds[label] = kinds.get(label, 0) + 1
            groups = ", ".join(f"{n} x {k}" for k, n in kinds.items()) + f" of {cap.layout.group_size}"
            rows.append(f"| {name} | {cap.kv_cache_dtype} | {cap.bytes_per_token / 1024:g} | {groups} | "
                        f"{cap.layout.num_padding_layers} | {cap.layout.block_bytes / 1024:g} | "
                        f"{cap.num_tokens:,} | {cap.num_blocks:,} | {cap.max_model_len:,} | "
                        f"{cap.max_concurrency:.2f}x |")
    return "\n".join(rows)


def replaced(text: str) -> str:
    """`text` with the table between the markers rendered anew."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render()}\n{END}{tail}"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    PAGE.write_text(replaced(PAGE.read_text()))
