"""KVCache pools, block copy (copy-on-write) and swap between pools."""
from __future__ import annotations

import pytest
import torch

from gpu_backend.kv_cache import KVCache, bytes_per_token, num_blocks_for_bytes
from gpu_backend.ops import KernelInputError, copy_blocks, swap_blocks
from simulator.core.errors import ConfigError


def _filled(num_layers=2, num_blocks=6, device="cpu", seed=0, pin_memory=False) -> KVCache:
    cache = KVCache(num_layers, num_blocks, 4, 2, 8, torch.float16, device, pin_memory=pin_memory)
    gen = torch.Generator().manual_seed(seed)
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.randn(pool.shape, generator=gen).to(pool.dtype))
    return cache


def test_bytes_per_token_matches_design_example():
    # OPT-13B: 2 * 5120 hidden (40 heads x 128) * 40 layers * 2 bytes = 819,200 bytes per token.
    assert bytes_per_token(40, 40, 128, torch.float16) == 819_200
    assert num_blocks_for_bytes(12 * 2**30, 16, 40, 40, 128, torch.float16) == 15_728 // 16


def test_pool_shapes_and_size():
    cache = KVCache(3, 10, 16, 4, 64, torch.float32)
    assert len(cache.k) == len(cache.v) == 3
    assert cache.k[0].shape == (10, 16, 4, 64)
    assert cache.bytes == 3 * 2 * 10 * 16 * 4 * 64 * 4
    assert cache.bytes == sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))


def test_bad_geometry_is_a_config_error():
    with pytest.raises(ConfigError, match="block_size"):
        KVCache(1, 4, 0, 1, 8)


@pytest.mark.parametrize("mapping", [{0: 3, 5: 1}, [(0, 3), (5, 1)], torch.tensor([[0, 3], [5, 1]])])
def test_copy_blocks_accepts_every_mapping_form(mapping):
    cache = _filled()
    before = [t.clone() for t in (*cache.k, *cache.v)]
    cache.copy_blocks(mapping)
    for old, new in zip(before, (*cache.k, *cache.v), strict=False):
        assert torch.equal(new[3], old[0]) and torch.equal(new[1], old[5])
        untouched = [0, 2, 4, 5]
        assert torch.equal(new[untouched], old[untouched])


def test_copy_blocks_reads_sources_before_writing():
    """A chain 0->1, 1->2 copies the old block 1 to 2, not the freshly written one."""
    cache = _filled()
    old = cache.k[0].clone()
    cache.copy_blocks([(0, 1), (1, 2)])
    assert torch.equal(cache.k[0][1], old[0]) and torch.equal(cache.k[0][2], old[1])


def test_copy_blocks_rejects_bad_mappings():
    cache = _filled()
    with pytest.raises(KernelInputError, match="out of range"):
        cache.copy_blocks([(0, 6)])
    with pytest.raises(KernelInputError, match="appears twice"):
        cache.copy_blocks([(0, 2), (1, 2)])
    with pytest.raises(KernelInputError, match="pairs"):
        copy_blocks(cache.k, cache.v, torch.tensor([1, 2, 3]))


def test_swap_out_and_in_round_trip():
    device_pool = _filled(num_blocks=6, seed=1)
    host_pool = KVCache(2, 3, 4, 2, 8, torch.float16, "cpu", pin_memory=True)
    saved = [t[[4, 1]].clone() for t in (*device_pool.k, *device_pool.v)]
    device_pool.swap_out(host_pool, [(4, 0), (1, 2)])
    for pool in (*device_pool.k, *device_pool.v):
        pool.zero_()
    device_pool.swap_in(host_pool, {0: 5, 2: 3})
    for old, new in zip(saved, (*device_pool.k, *device_pool.v), strict=False):
        assert torch.equal(new[5], old[0]) and torch.equal(new[3], old[1])
        assert not new[[0, 1, 2, 4]].any()


def test_swap_rejects_mismatched_pools():
    a, b = _filled(), KVCache(2, 6, 8, 2, 8, torch.float16)
    with pytest.raises(ConfigError, match="differ"):
        a.swap_out(b, [(0, 0)])
    with pytest.raises(KernelInputError, match="destination block id out of range"):
        swap_blocks(a.k[0], _filled(num_blocks=2).k[0], [(0, 5)])


def test_layers_of_different_groups_share_tensors_in_copies_and_swaps():
    """Layers 0 and 2 (one group) and 1 and 3 (another) as vLLM pools them: two tensors, not four."""
    slots = (0, 0, 1, 1)
    pool = KVCache(4, 6, 4, 2, 8, torch.float32, layer_slots=slots)
    assert pool.num_tensors == 2 and pool.k[0] is pool.k[1] and pool.v[2] is pool.v[3]
    assert pool.bytes == sum(t.numel() * t.element_size() for t in (*pool.k_pools, *pool.v_pools))
    assert pool.bytes == KVCache(2, 6, 4, 2, 8, torch.float32).bytes
    for i, tensor in enumerate((*pool.k_pools, *pool.v_pools)):
        tensor.fill_(i + 1)
    pool.copy_blocks([(1, 4)])
    host = KVCache(4, 2, 4, 2, 8, torch.float32, layer_slots=slots)
    pool.swap_out(host, [(4, 1)])
    assert [float(t[1].mean()) for t in (*host.k_pools, *host.v_pools)] == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ConfigError, match="differ"):
        pool.swap_out(KVCache(4, 2, 4, 2, 8, torch.float32), [(4, 1)])
    with pytest.raises(ConfigError, match="layer_slots must give each of 4 layers"):
        KVCache(4, 6, 4, 2, 8, layer_slots=(0, 0, 2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swap_between_cuda_and_pinned_cpu():
    device_pool = _filled(num_blocks=64, device="cpu", seed=2)
    gpu = KVCache(2, 64, 4, 2, 8, torch.float16, "cuda")
    for src, dst in zip((*device_pool.k, *device_pool.v), (*gpu.k, *gpu.v), strict=False):
        dst.copy_(src)
    host = KVCache(2, 16, 4, 2, 8, torch.float16, "cpu", pin_memory=True)
    assert host.pinned and host.k[0].is_pinned()
    gpu.swap_out(host, [(40, 0), (7, 15)])
    gpu.copy_blocks([(0, 1)])
    gpu.swap_in(host, [(0, 2), (15, 63)])
    torch.cuda.synchronize()
    for ref, pool in zip((*device_pool.k, *device_pool.v), (*gpu.k, *gpu.v), strict=False):
        assert torch.equal(pool[2].cpu(), ref[40]) and torch.equal(pool[63].cpu(), ref[7])
        assert torch.equal(pool[1].cpu(), ref[0])
