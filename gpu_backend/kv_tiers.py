"""The engine's KV tiers: the CPU and disk slots that hold the KV data of the blocks the core's tiers keep.

The core (simulator/core/paged/tiers.py) decides what each tier holds; its TierLog (tier_log.py) says, in
order, which GPU block a stored block comes from, which CPU slot spills to the disk, what is dropped and
which GPU block a loaded block goes to. `TierData.run` performs those moves before anything writes into
the device pool. Each slot holds one GPU block of every pool tensor's K and V ([tensors, 2, block_size,
kv_heads, head_dim]; a tensor per layer with one KV cache group), so a slot per GPU block serves any tier
block size; a model with several groups keeps one group's page per slot (kv_group_tier_data.py). The
CPU tier is pinned host memory when CUDA is present, its stores run on a side stream; the disk tier is a
file of the same slots, mapped into memory and given its full size up front so a full disk shows at
start, not in the middle of a run.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
import weakref
from contextlib import nullcontext
from pathlib import Path

import torch

from gpu_backend.kv_cache import KVCache
from simulator.core.errors import ConfigError

GIB = 1 << 30


class TierSlots:
    """One tier's data: `num_slots` slots, the free ones, and the slot of each block (by content hash)."""

    def __init__(self, name: str, data: torch.Tensor) -> None:
        self.name, self.data = name, data
        self.free = list(range(data.shape[0] - 1, -1, -1))  # lowest slot first
        self.slot: dict[int, int] = {}

    @property
    def num_slots(self) -> int:
        """Slots of the tier."""
        return self.data.shape[0]

    def take(self, h: int) -> int:
        """A free slot for block `h`."""
        if not self.free:
            raise RuntimeError(f"{self.name} tier: no free slot for a block its keys say fits")
        s = self.slot[h] = self.free.pop()
        return s

    def release(self, h: int) -> int:
        """Free block `h`'s slot; return it (its data stays until the slot is taken again)."""
        s = self.slot.pop(h)
        self.free.append(s)
        return s


def host_slots(cache: KVCache, num_slots: int) -> torch.Tensor:
    """CPU-tier slots with `cache`'s per-block geometry, pinned when CUDA can use them."""
    return torch.zeros(_shape(cache, num_slots), dtype=cache.dtype,
                       pin_memory=torch.cuda.is_available())


def _shape(cache: KVCache, num_slots: int) -> tuple[int, ...]:
    return num_slots, cache.num_tensors, 2, cache.block_size, cache.num_kv_heads, cache.head_dim


class DiskFile:
    """The disk tier's file of slots in `directory` (a temporary directory, removed on close, when None).
    The file goes when the tier is closed or garbage-collected, or when the process exits."""

    def __init__(self, cache: KVCache, num_slots: int, directory: str | None) -> None:
        shape = _shape(cache, num_slots)
        numel = math.prod(shape)
        nbytes = numel * cache.k[0].element_size()
        folder = Path(tempfile.mkdtemp(prefix="pagelab-kv-")) if directory is None else Path(directory)
        self.path = folder / f"kv-tier-{os.getpid()}-{id(self):x}.bin"
        self._remove = weakref.finalize(self, _remove, self.path, folder if directory is None else None)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(folder).free
            if free < nbytes:
                raise ConfigError(f"kv_offloading_disk_path {folder}: the disk tier needs {nbytes / GIB:.4g} "
                                  f"GiB (kv_offloading_disk_size), {free / GIB:.4g} GiB are free")
            with open(self.path, "wb") as f:
                _reserve(f.fileno(), nbytes)
        except OSError as exc:
            self.close()
            raise ConfigError(f"kv_offloading_disk_path {folder}: cannot create the disk tier's "
                              f"{nbytes / GIB:.4g} GiB file there ({exc.strerror or exc}); give a writable "
                              f"directory with room") from None
        except ConfigError:
            self.close()
            raise
        self.data = torch.from_file(str(self.path), shared=True, size=numel, dtype=cache.dtype).view(shape)

    def close(self) -> None:
        """Remove the file (and the temporary directory it was made in)."""
        self.data = None
        self._remove()


def _remove(path: Path, own_dir: Path | None) -> None:
    """Delete the disk tier's file, and its directory when it was made for it."""
    if path.is_file():
        path.unlink()
    if own_dir is not None:
        shutil.rmtree(own_dir, ignore_errors=True)


def _reserve(fd: int, nbytes: int) -> None:
    """Give the file its full size on disk (blocks allocated, not a sparse hole), where the filesystem can."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except (AttributeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in (22, 95):  # EINVAL / EOPNOTSUPP: no fallocate
            raise
        os.ftruncate(fd, nbytes)


def slot_runs(keys: list[tuple]) -> list[tuple[int, int]]:
    """(first index, length) of each run of `keys` [(tier, slot)] whose slots follow one another in one
    tier: a host-device copy costs microseconds of set-up, so a run moves in one copy, not one per block.
    A key whose tier is None (data read out early) is a run of its own."""
    runs: list[tuple[int, int]] = []
    for i, (tier, slot) in enumerate(keys):
        if runs and tier is not None:
            start, n = runs[-1]
            if keys[start][0] is tier and keys[start][1] + n == slot:
                runs[-1] = (start, n + 1)
                continue
        runs.append((i, 1))
    return runs


class TierData:
    """The data of the engine's CPU and disk tiers, kept in step with the core's tiers by their log."""

    def __init__(self, cache: KVCache, tiers, log, disk_dir: str | None = None) -> None:
        self.cache, self.tiers, self.log = cache, tiers, log
        self.disk: DiskFile | None = None
        self.slots: dict[str, TierSlots] = {}
        for tier in tiers.tiers:
            name, n = tier.spec.name, tier.spec.num_blocks
            if name == "disk":
                self.disk = DiskFile(cache, n, disk_dir)
                self.slots[name] = TierSlots(name, self.disk.data)
            else:
                self.slots[name] = TierSlots(name, host_slots(cache, n))
        self.cuda = cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(cache.device) if self.cuda else None
        self.event = None  # recorded after side-stream stores a host read must wait for
        self._stores: list[tuple[int, TierSlots, int]] = []  # (GPU block, tier, slot) queued by `run`
        self.copied_in = dict.fromkeys(self.slots, 0)  # blocks loaded into the GPU pool, by tier
        self.copied_out = dict.fromkeys(self.slots, 0)  # blocks stored from the GPU pool, by tier

    # ----------------------------------------------------------------- queries
    def problems(self) -> list[str]:
        """Where the slots in use differ from the core tiers' keys (empty when in step)."""
        out = []
        for tier in self.tiers.tiers:
            slots = self.slots[tier.spec.name]
            if set(slots.slot) != set(tier.keys):
                out.append(f"{slots.name}: {len(slots.slot)} slots in use, {len(tier.keys)} keys")
            if len(slots.slot) + len(slots.free) != slots.num_slots:
                out.append(f"{slots.name}: {len(slots.slot)} used + {len(slots.free)} free slots != "
                           f"{slots.num_slots}")
        return out

    def block(self, name: str, h: int) -> torch.Tensor:
        """The data a tier holds for block `h` ([tensors, 2, block_size, kv_heads, head_dim])."""
        self._wait_host()
        slots = self.slots[name]
        return slots.data[slots.slot[h]]

    # ----------------------------------------------------------------- mutations
    def run(self) -> None:
        """Perform the moves the core logged since the last call (before the device pool is written)."""
        ops = self.log.take()
        if not ops:
            return
        if self.cuda:  # stores read blocks the forwards queued so far have written
            self.stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        loads = self._apply(ops)
        self._flush_stores()
        if self.cuda:  # loads and the next forward write blocks the side stream may still be reading
            torch.cuda.current_stream(self.cache.device).wait_stream(self.stream)
        if loads:
            self._load(loads)

    def _apply(self, ops: list) -> list[list]:
        """Apply the log's ops to the slots, queueing stores; the loads, [tier, slot, GPU block, data read
        early or None], to write once the stores have run."""
        loads: list[list] = []
        by_op: dict[int, list] = {}  # id of a load op -> its entry in `loads`
        by_dst: dict[int, list] = {}  # GPU block -> the entry of the load it holds from here on
        for op in ops:
            kind = op[0]
            if kind == "placed":
                for load in op[1]:
                    by_dst[load[3]] = by_op[id(load)]
                continue
            tier = self.slots[op[1]]
            if kind == "put":
                h, src = op[2], op[3]
                slot = tier.take(h)
                if isinstance(src, str):  # a spill: the block leaves the tier above with its data
                    above = self.slots[src]
                    old = above.release(h)
                    self._keep_reads(loads, above, old)
                    self._wait_host()
                    tier.data[slot].copy_(above.data[old])
                elif src in by_dst:  # the GPU block is the target of a load not written yet: its data
                    entry = by_dst[src]
                    self._wait_host()
                    tier.data[slot].copy_(entry[0].data[entry[1]] if entry[3] is None else entry[3])
                else:
                    self._from_device(src, tier, slot)
            elif kind == "drop":
                self._keep_reads(loads, tier, tier.release(op[2]))
            else:
                entry = [tier, tier.slot[op[2]], op[3], None]
                loads.append(entry)
                by_op[id(op)] = entry
        return loads

    def close(self) -> None:
        """Remove the disk tier's file."""
        if self.disk is not None:
            self.disk.close()

    def _keep_reads(self, loads: list[list], tier: TierSlots, slot: int) -> None:
        """`slot` of `tier` is freed: loads still to read it read it now, before it is reused."""
        for entry in loads:
            if entry[3] is None and entry[0] is tier and entry[1] == slot:
                self._wait_host()
                entry[3] = tier.data[slot].clone()

    def _from_device(self, bid: int, tier: TierSlots, slot: int) -> None:
        """Queue the copy of GPU block `bid` into `slot`; queued copies run together (`_flush_stores`)
        before anything reads a host slot."""
        self._stores.append((bid, tier, slot))
        self.copied_out[tier.name] += 1

    def _flush_stores(self) -> None:
        """Run the queued stores: each tensor's blocks gathered on the device in one op, then one copy per
        run of consecutive slots (on the side stream into pinned memory under CUDA)."""
        stores, self._stores = self._stores, []
        if not stores:
            return
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            staging = self._gather([b for b, _, _ in stores])
            for i, n in slot_runs([(tier, slot) for _, tier, slot in stores]):
                tier, slot = stores[i][1], stores[i][2]
                dst = tier.data[slot:slot + n]
                dst.copy_(staging[i:i + n], non_blocking=self.cuda and dst.is_pinned())
        if self.cuda:
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def _gather(self, bids: list[int]) -> torch.Tensor:
        """The GPU blocks `bids`, [len(bids), tensors, 2, block_size, kv_heads, head_dim], on the device:
        each pool tensor's blocks read in one op."""
        cache = self.cache
        idx = torch.tensor(bids, dtype=torch.int64, device=cache.device)
        staging = torch.empty(_shape(cache, len(bids)), dtype=cache.dtype, device=cache.device)
        for i in range(cache.num_tensors):
            staging[:, i, 0] = cache.k_pools[i].index_select(0, idx)
            staging[:, i, 1] = cache.v_pools[i].index_select(0, idx)
        return staging

    def _load(self, loads: list[list]) -> None:
        """Write the loads into their GPU blocks: one copy per run of consecutive slots into a device
        staging buffer, then each tensor's blocks scattered in one op (a block loaded twice keeps its last
        load)."""
        cache = self.cache
        last = {entry[2]: entry for entry in loads}
        # In slot order, so that blocks stored together (consecutive slots) load in one copy each run.
        order = sorted(last.values(), key=lambda e: (e[3] is not None, e[0].name, e[1]))
        staging = torch.empty(_shape(cache, len(order)), dtype=cache.dtype, device=cache.device)
        keys = [(e[0], e[1]) if e[3] is None else (None, i) for i, e in enumerate(order)]
        for i, n in slot_runs(keys):
            tier, slot, _, data = order[i]
            src = tier.data[slot:slot + n] if data is None else data[None]
            staging[i:i + n].copy_(src, non_blocking=self.cuda and src.is_pinned())
        idx = torch.tensor([e[2] for e in order], dtype=torch.int64, device=cache.device)
        for i in range(cache.num_tensors):
            cache.k_pools[i].index_copy_(0, idx, staging[:, i, 0])
            cache.v_pools[i].index_copy_(0, idx, staging[:, i, 1])
        for entry in loads:
            self.copied_in[entry[0].name] += 1

    def _wait_host(self) -> None:
        """Before the host reads a slot: run the queued stores and wait for those on the side stream."""
        self._flush_stores()
        if self.event is not None:
            self.event.synchronize()
            self.event = None

