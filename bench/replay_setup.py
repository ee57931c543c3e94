"""What a calibration replays on: the engine options shared by `bench.profile` and `bench.calibration`.

A profile is only as good as the match between the replays it was fitted on and the replays it is
validated against, so both tools replay through one `ReplaySetup` (`replay`), into run folders written by
the same library functions as `pagelab replay`'s (gpu_backend/replay_run.py).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

# Per device: (model, backend, KV pool in GiB). The CPU row is the setup the bundled cpu-tiny is fitted to;
# on a GPU a fixed pool (not "all free memory") keeps a replay and its simulation on the same capacity.
DEFAULTS = {"cpu": ("tiny", "torch", 0.25), "cuda": ("llama-1b-shape", "triton", 8.0)}
MAX_MODEL_LEN = 4096  # tiny's own limit; GPU presets are cut to it so the same prompts run everywhere


@dataclass(frozen=True)
class ReplaySetup:
    """Model, device, backend and pool of every replay of a calibration or a validation."""

    device: str = "cpu"
    model: str = "tiny"
    backend: str = "torch"
    kv_memory_gb: float = 0.25
    max_model_len: int = MAX_MODEL_LEN
    block_size: int = 16
    enforce_eager: bool = False

    @property
    def clock(self) -> str:
        """CPU replays run on the CPU-time clock (docs/calibration.md); GPU replays on the wall clock."""
        return "cpu" if self.device == "cpu" else "wall"

    def replay_config(self, time_scale: float = 1.0, extra: dict | None = None):
        """The ReplayConfig of this setup (recompute preemption, prefix caching on; the allocator is set per
        run); `extra` holds the labels config.json records."""
        from gpu_backend.engine.engine_config import EngineConfig
        from gpu_backend.replay import ReplayConfig

        engine = EngineConfig(block_size=self.block_size, kv_memory_gb=self.kv_memory_gb,
                              max_model_len=self.max_model_len, preemption_mode="recompute",
                              enable_prefix_caching=True, enforce_eager=self.enforce_eager)
        return ReplayConfig(model=self.model, device=self.device, backend=self.backend, engine=engine,
                            time_scale=time_scale, clock=self.clock, extra=extra or {})

    @classmethod
    def for_device(cls, device: str, model: str | None = None, backend: str | None = None,
                   kv_memory_gb: float | None = None, **rest) -> ReplaySetup:
        """The setup of `device`, its defaults (DEFAULTS) filling what is None; ValueError for a device
        without defaults."""
        if device not in DEFAULTS:
            raise ValueError(f"--device must be one of {', '.join(DEFAULTS)}, got {device!r}")
        default_model, default_backend, default_kv = DEFAULTS[device]
        return cls(device=device, model=model or default_model, backend=backend or default_backend,
                   kv_memory_gb=default_kv if kv_memory_gb is None else kv_memory_gb, **rest)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplaySetup:
        """The setup named by `add_arguments`' options."""
        return cls.for_device(args.device, args.model, args.backend, args.kv_memory_gb,
                              max_model_len=args.max_model_len, block_size=args.block_size,
                              enforce_eager=args.enforce_eager)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """--device, --model, --backend, --kv-memory-gb, --max-model-len, --block-size, --enforce-eager."""
    ap.add_argument("--device", choices=sorted(DEFAULTS), default="cpu", help="cpu (CPU-time clock) or cuda "
                    "(wall clock)")
    ap.add_argument("--model", help="engine model preset (default: tiny on cpu, llama-1b-shape on cuda)")
    ap.add_argument("--backend", choices=("torch", "triton"), help="attention backend (default: torch on "
                    "cpu, triton on cuda)")
    ap.add_argument("--kv-memory-gb", type=float, help="KV pool in GiB (default: 0.25 on cpu, 8 on cuda)")
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help=f"longest sequence; longer "
                    f"prompts are clipped (default {MAX_MODEL_LEN})")
    ap.add_argument("--block-size", type=int, default=16, help="paged block size (default 16)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (a profile "
                    "fitted on eager replays stands for eager runs only)")


def replay(setup: ReplaySetup, trace: Path, out: Path, limit: int, time_scale: float = 1.0) -> Path:
    """Replay the first `limit` requests of the trace file `trace` on `setup` (paged allocator) into the run
    folder `out`, replacing the one there: the folder `pagelab replay TRACE --limit N --time-scale S` with
    the setup's options writes."""
    from bench.run_tools import serving_metrics
    from gpu_backend.replay_run import replay_configs, replay_metadata, replay_to_dir, run_labels
    from traces import load_trace
    from traces.stats import trace_info

    source = str(trace)
    df = load_trace(source).iloc[:limit].reset_index(drop=True)
    info = {"source": source, **trace_info(df), "rate_override": None, "burstiness": None, "limit": limit,
            "time_scale": time_scale}
    configs = replay_configs(["paged"], setup.replay_config(time_scale, run_labels(source, limit)))
    replay_to_dir(df, configs, info, out, metadata=replay_metadata(configs, source),
                  before_write=lambda results: {"serving_metrics": serving_metrics(results)})
    print(f"replayed {len(df)} requests of {source} into {out}")
    return out
