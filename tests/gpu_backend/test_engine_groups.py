"""The engine on the shared core's KV cache groups: sliding groups hand out-of-window blocks back to the one
pool, other requests reuse them, and tokens stay those of a pool that keeps every block.

After every step the runs below fill each free block that holds no cached prefix with NaN in every pool
tensor, so a kernel that read a hole or a block handed back (instead of skipping it) would turn the
sampled tokens into garbage. tiny-hybrid alternates 32-token windows with full layers (two groups);
the Mistral-like model slides on every layer (one sliding group).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gpu_backend import LLMEngine, SamplingParams
from gpu_backend.engine.cuda_graph import DecodeGraphRunner, decode_graphs_apply
from gpu_backend.engine.group_tables import check_no_hole_read, pack_group_tables
from gpu_backend.engine.params import EngineInputError
from gpu_backend.model import CausalLM
from gpu_backend.model_presets import PRESETS, build_preset, init_random_weights
from gpu_backend.ops import get_backend
from gpu_backend.testing import generate_simple
from simulator.core.paged import BlockManager
from simulator.core.paged.kv_groups import GroupedBlockManager

pytestmark = pytest.mark.usefixtures("single_thread")

NEW = 48
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid() -> CausalLM:
    """tiny-hybrid: windows of 32 tokens on layers 0 and 2, full attention on 1 and 3."""
    return build_preset("tiny-hybrid", backend=get_backend("torch", "cpu"))


@pytest.fixture(scope="module")
def mistral_like() -> CausalLM:
    """tiny's shape with every layer sliding through a 24-token window, as Mistral's do."""
    config = dataclasses.replace(PRESETS["tiny"], name="tiny-mistral", architecture="MistralForCausalLM",
                                 sliding_window=24)
    model = CausalLM(config, dtype=torch.float32, backend=get_backend("torch", "cpu"))
    init_random_weights(model, 5)
    return model


def _prompts(lens, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1024, n).tolist() for n in lens]


class Run:
    """Steps an engine to completion, poisoning free uncached blocks after every step and recording what
    the sliding groups' tables show."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.holes = 0  # most hole entries seen in the live tables at once
        self.window_freed: dict[int, int] = {}  # block -> the sequence whose window handed it back
        self.reused = 0  # blocks taken by another sequence while the one that handed them back still ran
        # Blocks each sequence's sliding groups held when last seen (its longest length).
        self.sliding_held: dict[int, int] = {}

    def generate(self, prompts, params=GREEDY) -> list[list[int]]:
        """Every prompt's tokens, in prompt order (`params`: one for all, or one per prompt)."""
        e = self.engine
        each = params if isinstance(params, list) else [params] * len(prompts)
        ids = [e.add_request(p, q) for p, q in zip(prompts, each, strict=True)]
        done: dict[int, list[int]] = {}
        prev: dict[int, list[list[int | None]]] = {}
        while e.has_unfinished():
            for out in e.step().finished:
                done[out.request_id] = out.outputs[0].token_ids
            prev = self._observe(prev)
            self._poison()
        return [done[i] for i in ids]

    def _observe(self, prev):
        alloc = self.engine.allocator
        tables = alloc.tables.tables
        sliding = [g for g, s in enumerate(alloc.tables.specs) if s.window is not None]
        self.holes = max(self.holes, sum(b is None for t in tables.values() for table in t for b in table))
        for sid, groups in tables.items():
            for g in sliding:
                self.sliding_held[sid] = max(sum(b is not None for b in groups[h]) for h in sliding)
                old = prev.get(sid, [[]] * len(groups))[g]
                self.window_freed.update({b: sid for b, now in zip(old, groups[g], strict=False)
                                          if b is not None and now is None})
            for table in groups:
                self.reused += sum(1 for b in table if b is not None and self.window_freed.get(b, sid) != sid
                                   and self.window_freed[b] in tables)
        return {sid: [list(t) for t in groups] for sid, groups in tables.items()}

    def _poison(self) -> None:
        pool, cache = self.engine.allocator.pool, self.engine.cache.device_cache
        free = [b for b in range(pool.num_blocks) if pool.ref[b] == 0 and pool.key[b] is None]
        if free:
            for tensor in (*cache.k_pools, *cache.v_pools):
                tensor[free] = float("nan")


def test_tiny_hybrid_frees_window_blocks_that_others_reuse_with_the_tokens_of_one_group(hybrid):
    prompts = _prompts([40, 50, 36, 45])
    # 12 x 16 slots of every layer: 24 blocks of two layer pages shared by the two groups.
    engine = LLMEngine(hybrid, backend="torch", block_size=16, num_blocks=12, enable_prefix_caching=False,
                       watermark=0.0)
    assert isinstance(engine.allocator, GroupedBlockManager) and engine.allocator.num_blocks == 24
    assert engine.cache.device_cache.num_tensors == 2  # layers 0 and 1, 2 and 3 share a tensor
    run = Run(engine)
    got = run.generate(prompts)
    assert run.holes > 0 and run.reused > 0
    # A window of 32 spans ceil(31 / 16) = 2 blocks, plus the one being filled and one more at most; the
    # sequences end 76 to 97 tokens long, 5 blocks or more.
    assert len(run.sliding_held) == 4 and max(run.sliding_held.values()) <= 4
    one = LLMEngine(hybrid, backend="torch", block_size=16, num_blocks=64, enable_prefix_caching=False,
                    disable_hybrid_kv_cache_manager=True)
    assert isinstance(one.allocator, BlockManager) and one.kv_groups is None
    assert [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)] == got
    assert generate_simple(hybrid, prompts, NEW, block_size=16) == got


def test_all_sliding_model_runs_one_sliding_group_with_the_tokens_of_a_pool_keeping_all(mistral_like):
    prompts = _prompts([30, 41, 27, 33], seed=1)  # 19 blocks of prompt: one waits
    engine = LLMEngine(mistral_like, backend="torch", block_size=8, num_blocks=16,
                       enable_prefix_caching=False, watermark=0.0)
    assert len(engine.kv_groups.layout.groups) == 1 and engine.cache.device_cache.num_tensors == 4
    run = Run(engine)
    got = run.generate(prompts)
    assert run.holes > 0 and run.reused > 0
    # vLLM's --disable-hybrid-kv-cache-manager changes only models mixing full and sliding layers.
    flag = LLMEngine(mistral_like, backend="torch", block_size=8, num_blocks=16, enable_prefix_caching=False,
                     disable_hybrid_kv_cache_manager=True)
    assert isinstance(flag.allocator, GroupedBlockManager)
    every = LLMEngine(mistral_like, backend="torch", allocator="contiguous-oracle", num_blocks=400,
                      block_size=1)
    assert [o.outputs[0].token_ids for o in every.generate(prompts, GREEDY)] == got
    assert generate_simple(mistral_like, prompts, NEW, block_size=8) == got


def test_three_sliding_groups_one_padded_and_a_full_one_share_two_tensors():
    """Five sliding layers and two full ones: groups of two layers (the last sliding one padded), so layers
    of four groups share the pool's two tensors. The windows free enough that no request is preempted,
    where one group in the same bytes preempts."""
    sliding, full = ("sliding_attention",), ("full_attention",)
    types = sliding * 3 + full + sliding * 2 + full
    config = dataclasses.replace(PRESETS["tiny-hybrid"], hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1,
                                 sliding_window=8, layer_types=types, num_params=None)
    model = CausalLM(config, backend=get_backend("torch", "cpu"))
    init_random_weights(model, 3)
    prompts = _prompts([21, 21, 21], seed=5)
    engine = LLMEngine(model, backend="torch", block_size=4, num_blocks=12, watermark=0.0)
    layout = engine.kv_groups.layout
    assert [len(g.layers) for g in layout.groups] == [2, 2, 1, 2] and layout.num_padding_layers == 1
    assert engine.cache.device_cache.layer_slots == (0, 0, 0, 0, 1, 1, 1)
    run = Run(engine)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    got = run.generate(prompts, params)
    assert run.holes > 0 and engine.scheduler.num_preemptions == 0
    assert got == generate_simple(model, prompts, 20, block_size=4)
    one = LLMEngine(model, backend="torch", block_size=4, num_blocks=12, watermark=0.0,
                    disable_hybrid_kv_cache_manager=True)
    assert [o.outputs[0].token_ids for o in one.generate(prompts, params)] == got
    assert one.scheduler.num_preemptions > 0


def test_prefix_longer_than_the_window_hits_in_every_group_with_the_tokens_of_no_cache(hybrid):
    shared = _prompts([80], seed=2)[0]
    prompts = [shared + tail for tail in _prompts([7, 9], seed=3)]
    cached = LLMEngine(hybrid, backend="torch", block_size=16, num_blocks=32)
    run = Run(cached)
    got = [run.generate([p])[0] for p in prompts]  # one after the other: the second hits the first's blocks
    assert cached.allocator.stats.prefix_hit_tokens == 80
    plain = LLMEngine(hybrid, backend="torch", block_size=16, num_blocks=32, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)] == got
    assert plain.allocator.stats.prefix_hit_tokens == 0


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, n=2, temperature=0.8, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=30, beam_width=3, ignore_eos=True),
], ids=["parallel-samples", "beams"])
def test_sequences_sharing_a_prompt_fork_every_group(hybrid, params):
    prompts = _prompts([40, 37], seed=4)
    outs = []
    for flag in (False, True):
        engine = LLMEngine(hybrid, backend="torch", block_size=16, num_blocks=64,
                           disable_hybrid_kv_cache_manager=flag)
        outs.append([[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params)])
    assert outs[0] == outs[1] and len(outs[0][0]) == params.width


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
def test_recomputed_samples_come_back_in_every_group_with_their_tokens(hybrid, caching):
    """Two samples preempted by recompute after diverging come back with all their tokens in each group,
    so the request the pool admitted is not rejected later; a request whose samples could not all come
    back at once is refused up front."""
    short, long = _prompts([60, 40], seed=4)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    samples = SamplingParams(max_tokens=20, temperature=1.0, n=2, seed=7, ignore_eos=True)
    pool = dict(backend="torch", block_size=4, watermark=0.0, enable_prefix_caching=caching)
    roomy = LLMEngine(hybrid, num_blocks=64, **pool).generate([long], samples)
    engine = LLMEngine(hybrid, num_blocks=30, **pool)
    outputs = engine.generate([short, long], [greedy, samples])
    assert engine.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outputs[1:]] == \
        [[c.token_ids for c in o.outputs] for o in roomy]
    assert engine.allocator.breakdown().allocated == 0
    # 40 + 60 tokens: re-admitted, two samples hold 25 blocks each in each of the 2 groups.
    with pytest.raises(EngineInputError, match="needs up to 100 KV blocks but the pool has 70"):
        LLMEngine(hybrid, num_blocks=35, **pool).add_request(long, SamplingParams(max_tokens=60, n=2))


_TRITON_SCRIPT = """
import dataclasses, json, sys
from gpu_backend import LLMEngine, SamplingParams
from gpu_backend.model import CausalLM
from gpu_backend.model_presets import TINY_HYBRID, init_random_weights
from gpu_backend.ops import get_backend
backend, out = sys.argv[1], {}
config = dataclasses.replace(TINY_HYBRID, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
                             layer_types=("sliding_attention", "full_attention"), num_params=None)
model = CausalLM(config, backend=get_backend(backend, "cpu"))
init_random_weights(model, 3)
params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
for layout in sys.argv[2:]:
    engine = LLMEngine(model, backend=backend, block_size=4, num_blocks=16, enable_chunked_prefill=True,
                       max_num_batched_tokens=8, max_num_seqs=2,
                       disable_hybrid_kv_cache_manager=layout == "one-group")
    outs = engine.generate([list(range(3, 17)), [5, 6, 7]], params)
    out[layout] = [type(engine.allocator).__name__, [o.outputs[0].token_ids for o in outs]]
print("tokens", json.dumps(out))
"""


@pytest.mark.slow
def test_triton_kernels_under_interpreter_read_each_groups_tables():
    """An 8-token window over blocks of 4, a 14-token prompt fed in chunks and decoded to 24 tokens:
    the Triton kernels (interpreted on CPU, in a subprocess because TRITON_INTERPRET must be set before
    they are defined) give the torch backend's tokens, with one group or two."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    got = {}
    for backend, layouts in (("triton", ["grouped"]), ("torch", ["grouped", "one-group"])):
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, backend, *layouts], env=env,
                              capture_output=True, text=True, timeout=600,
                              cwd=Path(__file__).resolve().parents[2])  # the repo root
        assert proc.returncode == 0, proc.stderr[-2000:]
        got[backend] = json.loads(proc.stdout.split("tokens ", 1)[1])
    assert got["triton"]["grouped"] == got["torch"]["grouped"]
    assert got["torch"]["grouped"][0] == "GroupedBlockManager"
    assert got["torch"]["one-group"][0] == "BlockManager"
    assert got["torch"]["grouped"][1] == got["torch"]["one-group"][1]


def test_grouped_pool_has_the_bytes_of_one_group_and_refuses_what_never_fits(hybrid):
    grouped = LLMEngine(hybrid, backend="torch", block_size=16, num_blocks=8)
    one = LLMEngine(hybrid, backend="torch", block_size=16, num_blocks=8,
                    disable_hybrid_kv_cache_manager=True)
    assert grouped.cache.bytes == one.cache.bytes
    # 16 blocks: a 200-token request holds 13 full-attention blocks and up to 13 sliding ones at first.
    with pytest.raises(EngineInputError, match="needs up to 26 KV blocks but the pool has 16"):
        grouped.add_request(list(range(3, 203)), SamplingParams(max_tokens=1))
    grouped.add_request(list(range(3, 103)), SamplingParams(max_tokens=60))  # 7 + 7 blocks at first


def test_config_records_the_flag_only_when_set(hybrid):
    plain = LLMEngine(hybrid, backend="torch", num_blocks=8)
    assert "disable_hybrid_kv_cache_manager" not in plain.config.to_dict()
    flagged = LLMEngine(hybrid, backend="torch", num_blocks=8, disable_hybrid_kv_cache_manager=True)
    assert flagged.config.to_dict()["disable_hybrid_kv_cache_manager"] is True


def test_grouped_engines_take_exact_steps_and_graph_buffers_per_group(hybrid):
    """No decode batch (it keeps one table per sequence); graphs on CUDA, fed a table per group."""
    engine = LLMEngine(hybrid, backend="torch", num_blocks=8)
    assert engine.decoder is None and engine.scheduler.decode is None
    assert decode_graphs_apply("cuda", "triton", False) and not decode_graphs_apply("cuda", "triton", True)


@pytest.mark.parametrize("model_name", ["hybrid", "mistral_like"])
def test_padded_graph_buffers_per_group_give_the_tokens_of_eager_steps(request, model_name):
    """What a grouped engine's graphs compute (each group's tables and slots copied into bucket-sized
    buffers, padding rows), run eagerly on the CPU: the tokens of eager steps, holes never read."""
    model = request.getfixturevalue(model_name)
    prompts = _prompts([40, 50, 36, 45, 23], seed=6)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 12, 30, 48, 20)]

    def engine():
        return LLMEngine(model, backend="torch", block_size=8, num_blocks=40, enable_prefix_caching=False,
                         watermark=0.0, max_num_seqs=8, max_model_len=128)
    want = [o.outputs[0].token_ids for o in engine().generate(prompts, params)]
    graphed = engine()
    runner = DecodeGraphRunner(graphed._forward, 8, 128 // 8 + 1, 128, False, "cpu", capture=False,
                               layer_group=graphed.group_inputs.layer_group)
    graphed.graph_runner = runner
    sizes: list[int] = []
    real_replay = runner.replay
    runner.replay = lambda n, longest=None: sizes.append(n) or real_replay(n, longest)
    run = Run(graphed)
    assert run.generate(prompts, params) == want
    assert run.holes > 0 and 5 in sizes and min(sizes) < 5  # full and shrinking decode batches


def test_a_step_reading_or_writing_a_hole_is_refused():
    tables, lens = pack_group_tables([[None, None, 7, 8], [3, 4]])
    assert tables.tolist() == [[-1, -1, 7, 8], [3, 4, 0, 0]] and lens.tolist() == [4, 2]
    check_no_hole_read(tables, np.array([2, 0]), group=1)
    with pytest.raises(RuntimeError, match="group 1: sequence 0 of the step reads block 1"):
        check_no_hole_read(tables, np.array([1, 0]), group=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_grouped_engine_graphs_give_the_tokens_of_eager_steps():
    model = build_preset("tiny-hybrid", dtype="float16", device="cuda", backend=get_backend("triton", "cuda"))
    prompts = _prompts([40, 50, 36, 45, 23], seed=6)
    outs = {}
    for eager in (True, False):
        engine = LLMEngine(model, block_size=16, num_blocks=40, max_num_seqs=8, max_model_len=128,
                           enforce_eager=eager)
        assert (engine.graph_runner is None) == eager and engine.kv_groups is not None
        outs[eager] = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert outs[True] == outs[False]
