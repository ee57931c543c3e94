"""Engine benchmarks (opt-in: `make bench`). The CPU target: on a 64-request trace with the tiny
model, the paged engine's output throughput is at least 2x that of transformers' padded batched generate.

The workload is the first 64 requests of the bundled azure-conv trace with prompts clipped so that
prompt + output <= 1024 tokens (unclipped, transformers' padded batches take ~8 minutes on 2 cores);
docs/performance.md records the numbers of both variants.
"""
import pytest

from bench.engine import compare

pytest.importorskip("transformers")

TARGET_SPEEDUP = 2.0


def test_engine_vs_transformers_generate_cpu(benchmark):
    result = benchmark.pedantic(compare, kwargs={"max_model_len": 1024, "limit": 64}, rounds=1, iterations=1)
    benchmark.extra_info.update({
        "engine_tokens_per_s": result["engine"]["tokens_per_s"],
        "transformers_tokens_per_s": result["transformers"]["tokens_per_s"],
        "speedup": result["speedup"], **result["workload"]})
    assert result["engine"]["output_tokens"] == result["transformers"]["output_tokens"]
    assert result["speedup"] >= TARGET_SPEEDUP, result
