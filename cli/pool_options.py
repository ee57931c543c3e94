"""The KV pool options `simulate` and `replay` share: KV cache groups and KV tiers (one declaration, the
same words in both helps)."""
from __future__ import annotations

import typer

from cli.help import POOL

KV_OFFLOADING_SIZE = typer.Option(None, rich_help_panel=POOL,
                                  help="GiB of CPU memory for a tier of prefix blocks (vLLM's name; default: "
                                       "none); swap uses its budget.")
KV_OFFLOADING_DISK_SIZE = typer.Option(None, rich_help_panel=POOL,
                                       help="GiB of disk for a tier below the CPU's.")
KV_OFFLOADING_BLOCK_SIZE = typer.Option(None, rich_help_panel=POOL,
                                        help="Tokens per tier block, a multiple of (default) --block-size.")
KV_OFFLOADING_POLICY = typer.Option("lru", rich_help_panel=POOL, help="Tier eviction: lru, lfu or s3fifo.")
KV_OFFLOADING_STORE = typer.Option("lazy", rich_help_panel=POOL,
                                   help="lazy: store blocks the GPU evicts; eager: blocks their request "
                                        "releases.")
CPU_OFFLOAD_BANDWIDTH_GBPS = typer.Option(None, rich_help_panel=POOL,
                                          help="CPU tier -> GPU GB/s (default: the GPU's PCIe).")
DISK_OFFLOAD_BANDWIDTH_GBPS = typer.Option(6.0, rich_help_panel=POOL, help="Disk tier -> GPU GB/s.")
HYBRID_KV_CACHE = typer.Option(True, "--hybrid-kv-cache/--disable-hybrid-kv-cache-manager",
                               rich_help_panel=POOL,
                               help="Group a model's layers by attention type, as vLLM (sliding windows free "
                                    "blocks); the other keeps every token on every layer in one group.")
