"""Where a steady decode step's time goes: the engine's wall time per step against the device's busy time,
and the kernels that fill it (`python -m bench.decode_profile`; a part of the GPU check).

`num_seqs` requests of `prompt_len` tokens run to steady decode (every sequence running, none finishing),
then `steps` decode steps run under torch.profiler. Reported per step: the wall time (p50), the device's
kernel time (the sum of kernel durations), the time of `engine.step` outside the forward call (on CUDA
the forward returns once its kernels are queued, so this includes waiting for them), and the kernels by
total time. Wall well above kernel time means the host or launch gaps set the step; kernel
time well above the weights+KV read time means the kernels do.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict


def profile_decode(model, num_seqs: int = 64, prompt_len: int = 1024, steps: int = 30,
                   max_model_len: int = 4096, top: int = 15) -> dict:
    """The per-step breakdown of `steps` steady decode steps of `num_seqs` sequences on `model`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.engine_host import record_forward_times
    from gpu_backend.engine.llm_engine import LLMEngine
    from gpu_backend.engine.params import SamplingParams

    cuda = model.device.type == "cuda"
    per_seq = prompt_len + steps + 64
    engine = LLMEngine(model, block_size=16, capacity_tokens=num_seqs * per_seq + max_model_len,
                       max_num_seqs=num_seqs, max_model_len=max_model_len,
                       max_num_batched_tokens=max(num_seqs * prompt_len, max_model_len))
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request([1 + (7 * i + j) % 1000 for j in range(prompt_len)], params)
    for _ in range(100):  # prefill everything: then a step computes one token per sequence
        if engine.step().num_computed_tokens == num_seqs:
            break
    for _ in range(5):  # warm the decode path (graphs replay, kernels compiled)
        engine.step()
    engine.synchronize()
    forward_s = record_forward_times(engine)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    wall = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            result = engine.step()
            engine.synchronize()
            wall.append(time.perf_counter() - start)
            if result.num_computed_tokens != num_seqs or result.finished:
                raise RuntimeError(f"expected {num_seqs} decoding sequences, "
                                   f"got {result.num_computed_tokens}")
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if cuda and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.time_range.elapsed_us() / 1e3
    kernel_ms = sum(kernels.values()) / steps
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {"num_seqs": num_seqs, "prompt_len": prompt_len, "steps": steps, "device": str(model.device),
            "cuda_graphs": engine.graph_runner is not None,
            "wall_p50_ms": 1e3 * statistics.median(wall),
            "forward_call_p50_ms": 1e3 * statistics.median(forward_s),
            "host_outside_forward_p50_ms": 1e3 * statistics.median(
                w - f for w, f in zip(wall, forward_s, strict=True)),
            "kernel_ms_per_step": kernel_ms if cuda else None,
            "kernels": [{"name": name[:120], "ms_per_step": ms / steps} for name, ms in ranked]}


def main(argv: list[str] | None = None) -> int:
    """Command line of `python -m bench.decode_profile`."""
    ap = argparse.ArgumentParser(prog="python -m bench.decode_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b-shape", help="model preset (default llama-1b-shape)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    ap.add_argument("--num-seqs", type=int, default=64, help="running sequences (default 64)")
    ap.add_argument("--prompt-len", type=int, default=1024, help="tokens per prompt (default 1024)")
    ap.add_argument("--steps", type=int, default=30, help="profiled decode steps (default 30)")
    args = ap.parse_args(argv)
    from gpu_backend.model_presets import build_preset
    from gpu_backend.ops import get_backend

    on_cuda = args.device == "cuda"
    model = build_preset(args.model, dtype="bfloat16" if on_cuda else "float32", device=args.device,
                         backend=get_backend("triton" if on_cuda else "torch", args.device))
    print(json.dumps(profile_decode(model, args.num_seqs, args.prompt_len, args.steps), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
