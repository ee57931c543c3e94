"""`pagelab plan`: the KV cache groups and pool of a model, as text and JSON, and its input errors."""
from __future__ import annotations

import json

from tests.cli.clirun import one_line_error, pagelab


def test_plan_prints_the_groups_and_vllms_two_lines():
    result = pagelab("plan", "--model", "gemma-3-27b", "--gpu", "h100-80gb", "--kv-cache-dtype", "fp8",
                     "--max-model-len", "32768", COLUMNS="80")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "6 x sliding_window 1024 (52 layers + 8 padding), 1 x full (10 layers)" in out
    assert "GPU KV cache size:" in out and "Maximum concurrency for 32,768 tokens per request" in out
    assert max(len(line) for line in out.splitlines() if "│" in line or "─" in line) <= 80


def test_plan_json_matches_the_arithmetic():
    result = pagelab("plan", "--model", "gpt-oss-20b", "--kv-memory-gb", "40", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    # 40 GiB // (12 layers x 32 KiB pages); the tokens split between 2 groups.
    assert plan["num_blocks"] == 40 * 2**30 // (12 * 32768) == 109_226
    assert plan["num_tokens"] == 109_226 // 2 * 16
    assert [g["kind"] for g in plan["kv_groups"]] == ["sliding_window", "full"]
    assert plan["blocks_per_request"] == 8192 + 521 and plan["padding_layers"] == 0
    flat = json.loads(pagelab("plan", "--model", "gpt-oss-20b", "--kv-memory-gb", "40", "--json",
                              "--no-hybrid").stdout)
    assert len(flat["kv_groups"]) == 1 and flat["blocks_per_request"] == 8192


def test_plan_without_a_pool_size_is_one_line_error():
    assert "--gpu or --kv-memory-gb" in one_line_error(pagelab("plan", "--model", "llama-3.1-8b"))
    unknown_weights = one_line_error(pagelab("plan", "--model", "gpt-oss-120b", "--gpu", "h200"))
    assert "give its size (--kv-memory-gb)" in unknown_weights


def test_an_unknown_weight_size_names_the_option_once():
    line = one_line_error(pagelab("plan", "--model", "gpt-oss-20b", "--gpu", "h100-80gb"))
    assert line.count("kv-memory-gb") == 1 and "kv_memory_gb" not in line, line


def test_plan_says_when_vllm_would_refuse_to_start_and_the_longest_length_that_fits():
    text = pagelab("plan", "--model", "llama-3.1-8b", "--kv-memory-gb", "1", COLUMNS="200")
    assert text.returncode == 0, text.stderr
    assert ("vLLM would not start: to serve one request of max_model_len 131,072 tokens, 16.00 GiB of KV "
            "cache is needed, more than the 1.00 GiB available. Based on the available memory, the "
            "estimated maximum model length is 8,192.") in text.stdout
    plan = json.loads(pagelab("plan", "--model", "llama-3.1-8b", "--kv-memory-gb", "1", "--json").stdout)
    assert (plan["fits_max_model_len"], plan["estimated_max_model_len"]) == (False, 8192)
    assert plan["request_kv_bytes"] == 16 * 2**30
    fits = pagelab("plan", "--model", "llama-3.1-8b", "--kv-memory-gb", "1", "--max-model-len", "8192")
    assert fits.returncode == 0 and "would not start" not in fits.stdout


def test_plan_warns_of_a_max_model_len_past_the_models_context_as_simulate_does():
    args = ("--model", "mistral-7b-v0.1", "--gpu", "a100-80gb", "--max-model-len")
    for extra in ((), ("--json",)):
        long = pagelab("plan", *args, "40000", *extra)
        assert long.returncode == 0, long.stderr
        assert "longer than mistral-7b-v0.1's context of 32,768 tokens (vLLM refuses it" in long.stderr
        assert "context" not in pagelab("plan", *args, "32768", *extra).stderr


def test_plan_of_a_folder_without_a_config_names_the_folder(tmp_path):
    line = one_line_error(pagelab("plan", "--model", tmp_path, "--gpu", "h200"))
    assert f"{tmp_path}: the folder has no config.json" in line


def test_plan_refuses_a_kv_pool_larger_than_the_gpu():
    line = one_line_error(pagelab("plan", "--model", "llama-3-8b", "--gpu", "h200", "--kv-memory-gb", "1e12"))
    assert "--kv-memory-gb 1e+12 GiB is more than the 141 GiB of --gpu h200" in line
    # Without a GPU nothing bounds the pool but what its bytes can count.
    assert pagelab("plan", "--model", "llama-3-8b", "--kv-memory-gb", "1e12").returncode == 0
    assert "is too large" in one_line_error(pagelab("plan", "--model", "llama-3-8b", "--kv-memory-gb", "inf"))
