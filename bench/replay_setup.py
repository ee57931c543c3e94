"""What a calibration replays on: the engine options shared by `bench.profile` and `bench.calibration`.

A profile is only as good as the match between the replays it was fitted on and the replays it is
validated against, so both tools build their `pagelab replay` options from one `ReplaySetup`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

# Per device: (model, backend, KV pool in GiB). The CPU row is what the bundled cpu-tiny was measured with;
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

    def replay_options(self) -> tuple[str, ...]:
        """The `pagelab replay` options of this setup (recompute preemption, prefix caching on)."""
        return ("--model", self.model, "--device", self.device, "--backend", self.backend,
                "--clock", self.clock, "--block-size", str(self.block_size),
                "--kv-memory-gb", f"{self.kv_memory_gb:g}", "--max-model-len", str(self.max_model_len),
                "--preemption", "recompute", "--prefix-caching", *("--enforce-eager",) * self.enforce_eager)

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


def pagelab(*args: object) -> None:
    """Run one `pagelab` command in this process; a non-zero exit stops the caller."""
    from cli import app

    code = app(args=[str(a) for a in args], prog_name="pagelab", standalone_mode=False)
    if code not in (None, 0):
        raise SystemExit(f"pagelab {' '.join(map(str, args))} failed (exit {code})")
