"""`pagelab bench engine`: the engine vs transformers' generate on the same requests and weights."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cli import app

runner = CliRunner()


def test_bench_engine_runs_both_sides_on_the_same_output_tokens():
    result = runner.invoke(app, ["bench", "engine", "--limit", "2", "--max-model-len", "96",
                                 "--hf-batch-size", "2", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output[result.output.index("["):])
    assert (row["device"], row["dtype"]) == ("cpu", "float32")
    assert row["requests"] == 2 and row["output_tokens"] > 0
    assert row["engine_tok_s"] > 0 and row["transformers_tok_s"] > 0
    assert row["speedup"] == pytest.approx(row["engine_tok_s"] / row["transformers_tok_s"])


@pytest.mark.parametrize("args, needle", [(["--dtype", "int8"], "--dtype"),
                                          (["--hf-batch-size", "0"], "--hf-batch-size"),
                                          (["--limit", "0"], "--limit")])
def test_bench_engine_rejects_bad_options(args, needle):
    result = runner.invoke(app, ["bench", "engine", *args])
    assert result.exit_code == 2
    assert needle in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_engine_on_cuda_reports_bf16_triton():
    from bench.engine import compare

    r = compare(trace="azure-conv", limit=2, max_model_len=96, device="cuda", hf_batch_size=2)
    assert (r["device"], r["dtype"], r["backend"]) == ("cuda", "bfloat16", "triton")
    wanted = r["workload"]["output_tokens"]
    assert r["engine"]["output_tokens"] == r["transformers"]["output_tokens"] == wanted
