"""The KV pool options `simulate` and `replay` share: KV cache groups and KV tiers (one declaration, the
same words in both helps); and the pool a trace could never fill, refused by `simulate` and `sweep`."""
from __future__ import annotations

import typer

from cli.common import UserError
from cli.help import POOL

KV_OFFLOADING_SIZE = typer.Option(None, rich_help_panel=POOL,
                                  help="GiB of CPU memory for a tier of prefix blocks (vLLM's name; default: "
                                       "none); swap uses its budget.")
KV_OFFLOADING_DISK_SIZE = typer.Option(None, rich_help_panel=POOL,
                                       help="GiB of disk for a tier below the CPU's.")
KV_OFFLOADING_BLOCK_SIZE = typer.Option(None, rich_help_panel=POOL,
                                        help="Tokens per tier block, a multiple of (default) --block-size.")
KV_OFFLOADING_POLICY = typer.Option(None, rich_help_panel=POOL,
                                    help="Tier eviction: lru (default), lfu or s3fifo.")
KV_OFFLOADING_STORE = typer.Option(None, rich_help_panel=POOL,
                                   help="lazy (default): store blocks the GPU evicts; eager: blocks their "
                                        "request releases.")
CPU_OFFLOAD_BANDWIDTH_GBPS = typer.Option(None, rich_help_panel=POOL,
                                          help="CPU tier -> GPU GB/s (default: the GPU's PCIe).")
DISK_OFFLOAD_BANDWIDTH_GBPS = typer.Option(None, rich_help_panel=POOL,
                                           help="Disk tier -> GPU GB/s (default 6).")
HYBRID_KV_CACHE = typer.Option(True, "--hybrid-kv-cache/--disable-hybrid-kv-cache-manager",
                               rich_help_panel=POOL,
                               help="Group a model's layers by attention type, as vLLM (sliding windows free "
                                    "blocks); the other keeps every token on every layer in one group.")


def tier_fields(kv_offloading_size: float | None, kv_offloading_disk_size: float | None, **given) -> dict:
    """The tier options as configuration fields (those not given are left to the configuration's
    defaults); a tier's option given without a tier is refused, not ignored."""
    fields = {"kv_offloading_size": kv_offloading_size, "kv_offloading_disk_size": kv_offloading_disk_size,
              **given}
    if kv_offloading_size is None and kv_offloading_disk_size is None:
        unused = ["--" + k.replace("_", "-") for k, v in given.items() if v is not None]
        if unused:
            raise UserError(f"{', '.join(unused)} {'applies' if len(unused) == 1 else 'apply'} to a KV tier: "
                            "give --kv-offloading-size or --kv-offloading-disk-size")
    return {k: v for k, v in fields.items() if v is not None}


# A paged pool is bookkept with Python objects per block (~80 bytes each): past this many blocks a pool
# that the trace cannot fill is refused instead of built (see pool_problem).
MAX_IDLE_POOL_BLOCKS = 2**21


def pool_problem(df, config) -> str | None:
    """Why the configured pool is absurdly large for this trace, or None.

    A pool is refused when it has more than MAX_IDLE_POOL_BLOCKS blocks AND more slots than the trace
    could ever occupy: at most max_num_seqs requests run at once, each holding at most max_model_len
    slots per sequence (twice that, for the rounding of pow2/buddy reservations).
    """
    capacity = config.capacity()
    blocks = capacity // config.block_size if config.is_paged else capacity // 16
    from traces.batches import FrameBatches, TraceBatches

    rows = df if isinstance(df, TraceBatches) else FrameBatches(df)
    width = max(int(max(c["n"].max(), c["beam_width"].max())) for c in rows.iter_batches(("n", "beam_width")))
    num = rows.num_rows
    bound = 2 * min(num, config.max_num_seqs) * config.resolved_max_model_len * width
    if blocks <= MAX_IDLE_POOL_BLOCKS or capacity <= bound:
        return None
    gib = bound * config.bytes_per_token / 2**30
    return (f"the KV pool holds {capacity:,} token slots, but this trace can never use more than {bound:,} "
            f"(at most {min(num, config.max_num_seqs):,} requests at once x max_model_len "
            f"{config.resolved_max_model_len:,} x {width} sequence(s) x 2); give at most "
            f"--kv-memory-gb {gib:.3g} or --capacity-tokens {bound}")
