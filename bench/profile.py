"""A latency profile for this machine in one command (`python -m bench.profile`; `make profile` calls it).

Four synthetic calibration traces are replayed on the engine and `pagelab calibrate` fits them with the
relative objective and the six-term model (`--sqrt-decode`), plus the seventh term (`--prefill-step`) where
decode steps run as CUDA graphs (docs/calibration.md, "On a GPU"). The traces span what a workload's steps can
be, two prompt ranges at two loads: prompts up to max_model_len (a fit extrapolates badly past its longest
prefill) in small and in large batches, and short prompts in batches of 2-8 and of 10-25, so that
per-sequence and per-context-token decode costs can be told apart at every batch size (docs/calibration.md).
Everything runs through the library functions behind `pagelab trace gen`, `replay` and `calibrate`, so the
traces and run folders under --runs are the ones those commands write.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.replay_setup import ReplaySetup, add_arguments, replay
from pagelab.errors import PagelabError

NUM_REQUESTS = 48
# name -> (Poisson rate in req/s, prompt range, seed); outputs 8-300 tokens in all four.
TRACES = {"cal1": (1.5, (16, 3796), 11), "cal2": (4.0, (16, 3796), 12), "cal3": (3.0, (16, 600), 13),
          "cal4": (10.0, (16, 600), 14)}
OUTPUT_RANGE = (8, 300)


def prompt_range(low_high: tuple[int, int], max_model_len: int) -> tuple[int, int]:
    """The recipe's prompt range, its top cut to leave room for the longest output under max_model_len."""
    low, high = low_high
    return low, max(low, min(high, max_model_len - OUTPUT_RANGE[1]))


def make_profile(setup: ReplaySetup, gpu: str, out: Path, runs: Path, num: int = NUM_REQUESTS,
                 sqrt_decode: bool = True, prefill_step: bool | None = None) -> Path:
    """Generate the calibration traces (`num` requests each), replay them on `setup` into `runs`, fit and
    write `out`. `prefill_step` None: on where the replays use CUDA graphs (cuda, not --enforce-eager)."""
    if prefill_step is None:
        prefill_step = graphed_decode(setup)
    from bench.run_tools import measured_steps, write_profile
    from traces import SyntheticConfig, generate_trace, save_trace

    runs.mkdir(parents=True, exist_ok=True)
    folders = []
    for name, (rate, prompts, seed) in TRACES.items():
        trace = runs / f"{name}.csv"
        save_trace(generate_trace(SyntheticConfig(
            num_requests=num, arrival="poisson", rate=rate, lengths="uniform",
            prompt_range=prompt_range(prompts, setup.max_model_len), output_range=OUTPUT_RANGE,
            max_model_len=setup.max_model_len, seed=seed)), trace)
        folders.append(replay(setup, trace, runs / f"replay-{name}", num))
    profile = write_profile(measured_steps(folders), out, gpu=gpu, relative=True, sqrt_decode=sqrt_decode,
                            prefill_step=prefill_step)
    fit = profile.meta["fit"]
    print(f"wrote {out}: fitted to {fit['num_steps']} steps, R² {fit['r2']:.3f}, median |rel error| "
          f"{100 * fit['median_abs_rel_error']:.1f}%")
    return out


def graphed_decode(setup: ReplaySetup) -> bool:
    """Whether the engine replays decode steps as CUDA graphs in this setup (the engine's own rule)."""
    from gpu_backend.engine.cuda_graph import decode_graphs_apply

    return decode_graphs_apply(setup.device, setup.backend, setup.enforce_eager)


def main(argv: list[str] | None = None) -> int:
    """Command line of `python -m bench.profile`."""
    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--gpu", help="GPU preset of the profile (default: cpu on cpu; required on cuda, e.g. "
                    "h100-80gb)")
    ap.add_argument("--out", type=Path, help="profile file (default: runs/profile/GPU-MODEL.json)")
    ap.add_argument("--num", type=int, default=NUM_REQUESTS, help=f"requests per calibration trace (default "
                    f"{NUM_REQUESTS})")
    ap.add_argument("--runs", type=Path, default=Path("runs/profile"), help="folder of the traces and "
                    "replays (default runs/profile)")
    ap.add_argument("--sqrt-decode", action=argparse.BooleanOptionalAction, default=True,
                    help="fit the sixth term, c5 * sqrt(decode sequences) (default: on; docs/calibration.md)")
    ap.add_argument("--prefill-step", action=argparse.BooleanOptionalAction, default=None,
                    help="fit the seventh term, c6 per step that prefills (default: on where decode steps "
                    "are CUDA graphs: cuda, triton, not --enforce-eager)")
    args = ap.parse_args(argv)
    setup = ReplaySetup.from_args(args)
    gpu = args.gpu or ("cpu" if setup.device == "cpu" else None)
    if gpu is None:
        ap.error("--gpu is required with --device cuda (the GPU preset the profile stands for, e.g. "
                 "h100-80gb)")
    out = args.out or args.runs / f"{gpu}-{setup.model}.json"
    try:
        make_profile(setup, gpu, out, args.runs, args.num, args.sqrt_decode, args.prefill_step)
    except PagelabError as exc:  # e.g. too few steps to fit: one line, as `pagelab calibrate` prints it
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
