"""What a serving engineer reads first: the KV pool in vLLM's words, vLLM-shaped results, Hugging Face ids,
and `compare` of two configurations."""
from __future__ import annotations

import json
import math
import re
import time

from clirun import pagelab

from simulator.config import SimConfig

SIM = ("simulate", "azure-conv", "--limit", "40")

# The keys of a `vllm bench serve --save-result` file that scripts read (vLLM's names, not pagelab's).
VLLM_KEYS = ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
             "max_concurrency", "duration", "completed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
             *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
               for stat in ("mean", "median", "std", "p99")))


def read_vllm_result(text: str) -> dict:
    """A reader written for vLLM's serving-benchmark results, as such scripts are: vLLM's keys only."""
    r = json.loads(text)
    time.strptime(r["date"], "%Y%m%d-%H%M%S")
    rate = r["request_rate"]
    return {"model": r["model_id"].split("/")[-1], "tokenizer": r["tokenizer_id"],
            "prompts": r["num_prompts"], "qps": math.inf if rate == "inf" else float(rate),
            "concurrency": r["max_concurrency"], "burstiness": r["burstiness"],
            "seconds": float(r["duration"]), "completed": int(r["completed"]),
            "tokens": (int(r["total_input_tokens"]), int(r["total_output_tokens"])),
            "req_s": r["request_throughput"], "goodput": r["request_goodput"],
            "tok_s": r["output_throughput"], "total_tok_s": r["total_token_throughput"],
            **{key: float(r[key]) for key in VLLM_KEYS if key.endswith("_ms")}}


def test_one_allocator_result_is_read_unchanged_by_a_vllm_script(tmp_path):
    r = pagelab(*SIM, "-a", "paged", "--model", "meta-llama/Meta-Llama-3-8B-Instruct", "--request-rate", "4",
                "--max-concurrency", "64", "--goodput", "ttft:500", "--save-result", "--result-filename",
                "r.json", "--json", "--out", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    saved = (tmp_path / "r.json").read_text()
    assert [k for k in VLLM_KEYS if k not in json.loads(saved)] == []
    read = read_vllm_result(saved)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    metrics = summary["serving_metrics"]["paged"]
    assert read["model"] == "Meta-Llama-3-8B-Instruct"
    assert read["tokenizer"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    # The trace's own gaps scaled to 4 req/s: no gamma shape (vLLM's 1.0 would claim Poisson arrivals).
    assert (read["prompts"], read["qps"], read["concurrency"], read["burstiness"]) == (40, 4.0, 64, None)
    assert (read["completed"], read["seconds"]) == (metrics["completed"], metrics["duration_s"])
    assert read["tokens"] == (metrics["total_input_tokens"], metrics["total_output_tokens"])
    assert read["p99_ttft_ms"] == metrics["p99_ttft_ms"] and read["mean_e2el_ms"] == metrics["mean_e2el_ms"]
    assert 0 < read["goodput"] <= read["req_s"]
    # --json prints the same object on stdout, one line per allocator; the tables are not printed.
    [line] = r.stdout.splitlines()
    assert json.loads(line) == json.loads(saved)
    # The registry entry ran, and the run folder says so.
    config = json.loads((tmp_path / "run" / "paged" / "config.json").read_text())
    assert config["model"] == "llama-3-8b"


def test_several_allocators_write_one_result_file_each(tmp_path):
    r = pagelab(*SIM, "-a", "paged,contiguous-max", "--save-result", "--result-filename", "x.json",
                "--request-rate", "2", "--burstiness", "0.5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ("paged", "contiguous-max"):
        result = json.loads((tmp_path / f"x-{name}.json").read_text())
        assert result["label"] == result["allocator"] == name
        assert result["model_id"] == "meta-llama/Meta-Llama-3-8B"  # the registry entry's checkpoint
        assert result["request_goodput"] is None and result["failed"] == 0
        assert (result["request_rate"], result["burstiness"]) == (2.0, 0.5)  # fresh gamma gaps
    assert not (tmp_path / "x.json").exists()


def _header(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^(GPU KV cache size|Maximum concurrency for [\d,]+ tokens per request): (.+)$",
                           stdout, re.M))


def test_the_kv_pool_is_printed_first_in_vllms_words(tmp_path):
    r = pagelab(*SIM, "-a", "paged", "--out", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cap = SimConfig().kv_capacity()
    lines = r.stdout.splitlines()
    assert lines[0] == "Model llama-3-8b on a100-80gb, KV cache in bfloat16 (128 KiB per token)"
    assert lines[1] == "KV pool: 0.9 x 80 GiB - 15.0 GiB weights - 1 GiB activations = 56.04 GiB"
    assert lines[2] == f"GPU KV cache size: {cap.num_tokens:,} tokens ({cap.num_blocks:,} blocks of 16)"
    assert lines[3] == f"Maximum concurrency for 8,192 tokens per request: {cap.max_concurrency:.2f}x"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["kv_cache"] == cap.to_dict()
    assert "Prefix cache hit rate (%)" in r.stdout


def test_utilization_and_kv_dtype_size_the_pool(tmp_path):
    def pool(*args) -> int:
        r = pagelab(*SIM, "-a", "paged", *args, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return int(_header(r.stdout)["GPU KV cache size"].split()[0].replace(",", ""))

    full, half, fp8 = pool(), pool("--gpu-memory-utilization", "0.5"), pool("--kv-cache-dtype", "fp8")
    assert half == SimConfig(gpu_memory_utilization=0.5).kv_capacity().num_tokens < full
    assert fp8 in (2 * full, 2 * full + 16)  # half the bytes per token: twice the tokens, in whole blocks
    bad = pagelab(*SIM, "--gpu-memory-utilization", "1.5", cwd=tmp_path)
    assert bad.returncode == 2 and "--gpu-memory-utilization must be in (0, 1], got 1.5" in bad.stderr


def test_a_local_model_folder_is_read_for_its_shape(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "tie_word_embeddings": True}))
    r = pagelab(*SIM, "-a", "paged", "--model", folder, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["model_id"] == str(folder) and result["kv_cache"]["bytes_per_token"] == 2 * 16 * 8 * 64 * 2
    assert result["kv_cache"]["max_model_len"] == 4096
    assert "Maximum concurrency for 4,096 tokens per request" in r.stderr  # the header goes to stderr


def test_an_unknown_model_lists_what_is_accepted(tmp_path):
    r = pagelab(*SIM, "--model", "meta-llama/Llama-9-70B", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unknown model 'meta-llama/Llama-9-70B'" in r.stderr and "Hugging Face id" in r.stderr


def test_compare_two_simulations_side_by_side(tmp_path):
    for name, block in (("bs16", "16"), ("bs32", "32")):
        r = pagelab(*SIM, "-a", "paged,contiguous-pow2", "--block-size", block, "--out", name, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    r = pagelab("compare", "bs16", "bs32", "--out", "cmp", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "simulated vs simulated" in r.stdout and "simulated vs measured" not in r.stdout
    rows = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["rows"]
    by_name = {(row["section"], row["quantity"]): (row["a"], row["b"]) for row in rows}
    assert by_name[("configuration", "block_size")] == (16, 32)
    assert by_name[("configuration", "allocator")] == ("paged", "paged")
    summary = json.loads((tmp_path / "bs32" / "paged" / "summary.json").read_text())
    assert by_name[("latency", "TTFT p99 (ms)")][1] == summary["ttft_s"]["p99"] * 1e3
    assert by_name[("memory (% of capacity)", "free")][1] == 100 * summary["memory"]["free"]
    assert {p.name for p in (tmp_path / "cmp").iterdir()} == {"comparison.json", "breakdown.png",
                                                            "latency_cdf.png"}
    # Two allocators of one run: their folders.
    r = pagelab("compare", "bs16/paged", "bs16/contiguous-pow2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"allocator +paged +contiguous-pow2", r.stdout)


def test_plot_window_draws_the_block_map_of_those_seconds(tmp_path):
    r = pagelab(*SIM, "-a", "paged", "--out", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = pagelab("plot", "run", "--only", "block_map", "--window", "5:10", "--out", "figs", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "figs" / "block_map.png").stat().st_size > 0
    for window, message in (("5", "--window '5': expected START:END in seconds"),
                            ("9e9:1e10", "starts after the end of the run")):
        bad = pagelab("plot", "run", "--only", "block_map", "--window", window, cwd=tmp_path)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr
