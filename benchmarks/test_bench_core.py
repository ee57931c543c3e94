"""Memory-core benchmarks (opt-in: `make bench`). The decode-heavy workload of issue 2."""
from bench.core import DecodeWorkload, run_bulk, run_single


def test_append_slot_single_token(benchmark):
    w = DecodeWorkload()
    benchmark.extra_info["tokens"] = (w.num_tokens // w.num_seqs) * w.num_seqs
    benchmark.pedantic(run_single, args=(w,), rounds=3, iterations=1)


def test_append_slots_bulk(benchmark):
    w = DecodeWorkload()
    benchmark.extra_info["tokens"] = (w.num_tokens // w.num_seqs) * w.num_seqs
    benchmark.pedantic(run_bulk, args=(w,), rounds=3, iterations=1)
