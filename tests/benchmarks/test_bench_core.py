"""Memory-core benchmarks (opt-in: `make bench`) on a decode-heavy workload (bench.core.DecodeWorkload)."""
from bench.core import DecodeWorkload, run_bulk, run_single


def test_append_slot_single_token(benchmark):
    w = DecodeWorkload()
    benchmark.extra_info["tokens"] = (w.num_tokens // w.num_seqs) * w.num_seqs
    benchmark.pedantic(run_single, args=(w,), rounds=3, iterations=1)


def test_append_slots_bulk(benchmark):
    w = DecodeWorkload()
    benchmark.extra_info["tokens"] = (w.num_tokens // w.num_seqs) * w.num_seqs
    benchmark.pedantic(run_bulk, args=(w,), rounds=3, iterations=1)


def _remove_and_append(container_type):
    """Remove a random running group and re-admit it, 20,000 times, among 256 running groups."""
    import random

    from simulator import Sequence, SequenceGroup

    groups = [SequenceGroup(i, [Sequence(i, 10, 20, request_id=i)]) for i in range(256)]
    order = random.Random(0).choices(range(256), k=20_000)
    running = container_type(groups)

    def run():
        for i in order:
            running.remove(groups[i])
            running.append(groups[i])
    return run


def test_running_groups_remove(benchmark):
    """Scheduler.running: a finished group leaves from anywhere (docs/performance.md)."""
    from simulator.core.sequence import RunningGroups

    benchmark.pedantic(_remove_and_append(RunningGroups), rounds=5, iterations=1)


def test_running_list_remove_for_comparison(benchmark):
    """A plain list for comparison: `list.remove` scans by identity."""
    benchmark.pedantic(_remove_and_append(list), rounds=5, iterations=1)
