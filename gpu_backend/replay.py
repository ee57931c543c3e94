"""Replaying a trace on the real engine, producing the same tables as a simulation.

Each request gets random prompt tokens of its length (seeded; requests that share recorded prefix blocks
share those blocks' tokens, so the prefix cache sees real hits) and is forced to generate exactly its
trace output length (ignore_eos). Arrivals are honoured on the wall clock after scaling by `time_scale`
(0: everything arrives at once). The loop mirrors `simulate()` step for step; time is measured: each
step's wall time (synchronized on a GPU) is its `dt_s`, and events carry wall-clock times (blocks are
taken when a step is scheduled and released when its forward is done, as in the simulator). The replay
runs on the simulation's driver (`simulator.loop.drive`) and records into the same output.

Arrivals are checked against recorded times only - the end of the previous step, or the arrival the loop
slept until - never a fresh clock reading, so `simulate --step-times-from` can replay the same decisions
(a request arriving during the loop's bookkeeping joins at the next check, a few microseconds later).
With `clock="cpu"` (CPU engine only) the replay runs on a virtual clock instead: it advances by the
process's CPU time while the engine works and jumps straight to the next arrival while it idles (no
sleeping). On a shared machine, wall-clock step times carry every time slice other processes take
(the same replay twice can differ by ~20% in median latency); CPU time carries only this
engine's own work, which is what a calibration should see. torch runs on one thread for such a replay,
so CPU time is the step's compute time.

Besides the simulator's tables, a replay writes `steps`: one row per engine step with the step-latency
model's inputs and the measured duration (what `pagelab calibrate` fits).

A device that runs out of memory in the middle of a replay (what gpu_backend/memory_budget.py could not
foresee) stops it cleanly: the steps so far make the result, the requests still in flight have no finish
time, and the summary's `incomplete` says where and why it stopped.
"""
from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from gpu_backend.engine.engine_config import EngineConfig
from gpu_backend.engine.llm_engine import LLMEngine
from gpu_backend.engine.params import EngineInputError, SamplingParams
from gpu_backend.memory_budget import is_out_of_memory
from simulator.loop import RunResult, drive
from simulator.loop.state import RunState
from simulator.metrics import add_latencies, run_summary
from simulator.output import InMemory
from simulator.timing.step_latency import step_features
from traces.schema import validate_trace

CLOCKS = ("wall", "cpu")


@dataclass(frozen=True)
class ReplayConfig:
    """Model, device and timing of a replay; `engine` holds the pool, allocator and scheduler options."""

    model: str = "tiny"
    device: str = "auto"
    backend: str = "auto"
    dtype: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    time_scale: float = 1.0
    seed: int = 0
    clock: str = "wall"  # or "cpu": the virtual CPU-time clock (module docstring)
    extra: dict = field(default_factory=dict, compare=False)  # labels copied into config.json


STEP_COLUMNS = ("step", "t_s", "dt_s", "num_batched_tokens", "num_prefill_tokens", "num_prefill_seqs",
                "num_decode_seqs", "batch_size", "sum_context", "attn_pairs", "kv_tokens_read",
                "num_swapped_blocks")


def step_row(step: int, start: float, dt: float, out, q_lens: list[int], context_lens: list[int]) -> tuple:
    """One row of the steps table (STEP_COLUMNS) from a step's schedule and its forward's inputs."""
    prefills = [sg for sg in out.scheduled if sg.is_prefill]
    num_prefill_tokens = sum(sg.num_new_tokens for sg in prefills)
    tokens, pairs, kv = step_features(np.asarray(q_lens, dtype=np.int64), np.asarray(context_lens, np.int64))
    swapped = len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out)
    return (step, start, dt, tokens, num_prefill_tokens, len(prefills), len(q_lens) - len(prefills),
            len(q_lens), kv, pairs, kv, swapped)


def steps_frame(rows: list[tuple]) -> pd.DataFrame:
    """The steps table with its documented dtypes (docs/run-format.md)."""
    df = pd.DataFrame(rows, columns=list(STEP_COLUMNS))
    return df.astype({c: np.float64 if c in ("t_s", "dt_s") else np.int64 for c in STEP_COLUMNS})


def clip_prompts(trace: pd.DataFrame, max_model_len: int) -> tuple[np.ndarray, int]:
    """Prompt lengths shortened so that prompt + output - 1 <= max_model_len; and how many were clipped.

    A request whose output alone is too long keeps its prompt and is rejected, as the simulator would.
    """
    prompt = trace["prompt_len"].to_numpy(np.int64)
    output = trace["output_len"].to_numpy(np.int64)
    limit = max_model_len + 1 - output
    clipped = np.where((prompt > limit) & (limit >= 1), limit, prompt)
    return clipped, int(np.count_nonzero(clipped != prompt))


def make_prompts(trace: pd.DataFrame, prompt_lens: np.ndarray, vocab_size: int, seed: int) -> list[list[int]]:
    """Seeded random prompt tokens; recorded prefix blocks get tokens that depend only on their key (a
    block the prompt covers in part, its first tokens), drawn apart from the prompts' own stream."""
    rng = np.random.default_rng(seed)
    has_prefix = "prefix_blocks" in trace.columns
    prompts = []
    for i, length in enumerate(prompt_lens.tolist()):
        tokens: list[int] = []
        if has_prefix and isinstance(trace["prefix_blocks"].iat[i], (list, tuple, np.ndarray)):
            size = int(trace["prefix_block_size"].iat[i])
            for key in trace["prefix_blocks"].iat[i]:
                if len(tokens) >= length:
                    break
                # [seed, 1, key]: a SeedSequence pads [seed, 0] to the prompts' own seed, so key 0 would
                # repeat the stream of the first prompt drawn from it.
                block_rng = np.random.default_rng([seed, 1, int(key) % (1 << 63)])
                tokens.extend(block_rng.integers(0, vocab_size, size)[:length - len(tokens)].tolist())
        tokens.extend(rng.integers(0, vocab_size, length - len(tokens)).tolist())
        prompts.append(tokens)
    return prompts


def request_params(output_len: int, n: int, beam_width: int, seed: int) -> SamplingParams:
    """Forced-length decoding: greedy, n seeded samples, or a beam."""
    if beam_width > 1:
        return SamplingParams(max_tokens=output_len, temperature=0.0, beam_width=beam_width, ignore_eos=True)
    if n > 1:
        return SamplingParams(max_tokens=output_len, temperature=1.0, n=n, seed=seed, ignore_eos=True)
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def make_engine(config: ReplayConfig, model=None, record_events: bool = False,
                clock: Callable[[], float] | None = None) -> LLMEngine:
    """The engine a replay runs on, tracking memory after every schedule."""
    ec = config.engine
    named = ("block_size", "num_blocks", "kv_memory_gb", "enable_prefix_caching", "allocator", "seed")
    opts = {k: v for k, v in ec.to_dict().items() if k not in named}
    return LLMEngine(config.model if model is None else model, device=config.device, backend=config.backend,
                     dtype=config.dtype, block_size=ec.block_size, num_blocks=ec.num_blocks,
                     kv_memory_gb=ec.kv_memory_gb, enable_prefix_caching=ec.enable_prefix_caching,
                     allocator=ec.allocator, seed=config.seed, record_events=record_events, clock=clock,
                     track_memory=True, **opts)


def replay(trace: pd.DataFrame, config: ReplayConfig, model=None,
           progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Replay `trace` on an engine built from `config` (over `model`, a CausalLM, when given)."""
    trace = validate_trace(trace, source="trace")
    if config.clock not in CLOCKS:
        raise EngineInputError(f"clock must be one of {', '.join(CLOCKS)}, got {config.clock!r}")
    clock = ReplayClock(config.clock)
    engine = make_engine(config, model, True, clock)
    if config.clock == "cpu" and engine.device.type != "cpu":
        raise EngineInputError(f"--clock cpu measures a CPU engine; this replay runs on {engine.device}")
    threads = torch.get_num_threads()
    if config.clock == "cpu":
        torch.set_num_threads(1)  # CPU time of one thread is the step's compute time
    try:
        return _replay(trace, config, engine, clock, progress)
    finally:
        torch.set_num_threads(threads)
        engine.close()  # the disk tier's file goes with the replay


class ReplayClock:
    """Seconds since the run started: wall time, or the virtual CPU-time clock (module docstring)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._read = time.perf_counter if kind == "wall" else time.process_time
        self.start()

    def start(self) -> None:
        """Time 0 is now (called once the model and the pool exist)."""
        self._base = self._read()

    def __call__(self) -> float:
        return self._read() - self._base

    def wait_until(self, t: float) -> None:
        """Sleep until `t` (wall), or jump there (cpu: idle time is not CPU time)."""
        now = self()
        if t > now:
            if self.kind == "wall":
                time.sleep(t - now)
            else:
                self._base -= t - now


@dataclass(eq=False)
class ReplayState(RunState):
    """A replay in progress: requests join the engine as their (scaled) arrival passes on its clock."""

    engine: LLMEngine | None = None
    clock: ReplayClock | None = None
    trace: pd.DataFrame | None = None
    arrival: list[float] = field(default_factory=list)  # seconds, as the run sees them (scaled)
    prompt: np.ndarray | None = None  # prompt lengths as run (clipped)
    prompts: list[list[int]] = field(default_factory=list)  # their tokens
    seed: int = 0
    step_rows: list[tuple] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    computed: int = 0  # tokens in the forwards

    def __post_init__(self) -> None:
        super().__post_init__()
        t = self.trace
        self.num_requests = len(t)
        self._ids = t["request_id"].to_numpy(np.int64).tolist()
        self._output = t["output_len"].to_numpy(np.int64).tolist()
        self._n = t["n"].to_numpy(np.int64).tolist()
        self._beam = t["beam_width"].to_numpy(np.int64).tolist()
        self.next_arrival = self.arrival[0] if self.arrival else math.inf

    def arrive_until(self, t: float) -> None:
        """Every request arriving at or before `t` joins the engine (`t` is a recorded time: see the module
        docstring)."""
        i, num = self.next, self.num_requests
        while i < num and self.arrival[i] <= t:
            self.log.open(i, (self._ids[i], self.arrival[i], int(self.prompt[i]), self._output[i], self._n[i],
                              self._beam[i]))
            params = request_params(self._output[i], self._n[i], self._beam[i], self.seed + i)
            self.engine.add_request(self.prompts[i], params, request_id=i, arrival_s=self.arrival[i],
                                    check=False)
            i += 1
        self.next = i
        self.next_arrival = self.arrival[i] if i < num else math.inf

    def idle_until(self, t: float) -> None:
        """Wait on the clock for the next arrival, logging the gap as the simulator does. The loop's clock
        then reads `t` itself (what the simulator's reads after the same gap), so the next arrival check
        admits exactly the requests the simulator's would; the sleep's overshoot is measured in the next
        step's start."""
        self.record_idle(self.clock(), t)
        self.clock.wait_until(t)
        self.now = max(t, self.now)


def _advance(run: ReplayState):
    """One engine step, measured and recorded; its schedule when nothing ran (the driver waits for the next
    arrival then), else None."""
    clock, engine = run.clock, run.engine
    start = clock()
    res = engine.step()
    engine.synchronize()
    end = clock()
    run.record_schedule(res.out, start, run.now)  # `now`: the step before's end, the last tokens' time
    for i in res.first_token:
        run.first_token[i] = end
    for o in res.finished:
        if run.log.is_open(o.request_id):  # a rejected request was retired when it was rejected
            run.finish[o.request_id] = end
            run.num_done += 1
            run.retire(o.request_id)
    if not res.ran:
        if res.out.blocks_to_swap_out:  # the only running groups swapped out: a step of copies alone
            run.record_idle(start, end)  # `now` stays: arrivals are checked at recorded step ends only
        return res.out
    dt = end - start
    run.step_rows.append(step_row(run.step, start, dt, res.out, res.q_lens, res.context_lens))
    run.record_step(start, dt, res.breakdown, res.counts, res.out.num_batched_tokens)
    run.step_times.append(dt)
    run.computed += res.num_computed_tokens
    gap, run.now = end - run.now, end
    run.add_gaps(res.later_token, gap)
    if res.num_batch_tokens:
        run.itl.add(gap, res.num_batch_tokens)
    return None


def _replay(trace: pd.DataFrame, config: ReplayConfig, engine: LLMEngine, clock: ReplayClock,
            progress: Callable[[int, int], None] | None) -> RunResult:
    engine.warmup()
    clock.start()  # the clock starts once the model and the pool exist
    prompt_lens, num_clipped = clip_prompts(trace, engine.max_model_len)
    prompts = make_prompts(trace, prompt_lens, engine.model.config.vocab_size, config.seed)
    ec = engine.config
    output = InMemory()
    run = ReplayState(allocator=ec.allocator, enable_prefix_caching=ec.enable_prefix_caching,
                      alloc=engine.allocator, sched=engine.scheduler, output=output, engine=engine,
                      clock=clock, trace=trace,
                      arrival=(trace["arrival_s"].to_numpy(np.float64) * config.time_scale).tolist(),
                      prompt=prompt_lens, prompts=prompts, seed=config.seed)
    stopped = None
    try:
        drive(run, _advance, progress, report_every=1)  # an engine step takes long enough to report each
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        stopped = _stop(run, exc)
        run.now = clock()
    # Otherwise the run ends where its last step did, as a simulation's does (not after the loop's own
    # bookkeeping), so that durations and throughputs compare.
    run.itl.flush()
    run.drain_events(final=True)
    kept = output.close()
    summary = add_latencies(run_summary(run, kept, run.now), kept.requests)
    summary["measured"] = _measured(engine, run.step_times, run.computed, num_clipped)
    if stopped is not None:
        summary["incomplete"] = stopped
    cfg = {**config.extra, "source": "replay", "model": config.model, "device": str(engine.device),
           "backend": engine.model.attn_backend.name, "dtype": str(engine.model.dtype).removeprefix("torch."),
           **engine.config.to_dict(), "allocator": engine.config.allocator,
           "capacity_tokens": int(engine.capacity_tokens), "capacity_source": engine.capacity_source,
           "max_model_len": int(engine.max_model_len), "bytes_per_token": int(engine.bytes_per_token),
           "time_scale": config.time_scale, "seed": config.seed, "num_clipped_prompts": num_clipped,
           "clock": config.clock}
    return RunResult(cfg, summary, kept.requests.frame, kept.memory, kept.events, kept.num_events,
                     kept.requests, steps=steps_frame(run.step_rows), transitions=kept.transitions,
                     refcounts=kept.refcounts, itl=run.itl)


def _stop(run: ReplayState, exc: BaseException) -> dict:
    """End a replay the device ran out of memory in: the requests in flight end unfinished; what the run
    records about where it stopped (its summary's `incomplete`)."""
    in_flight = run.log.in_flight()
    for row in in_flight:
        run.log.close(row)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what the failed step held, back to the device
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return {"reason": f"the device ran out of memory ({type(exc).__name__}: {first})",
            "num_steps": int(run.step), "num_requests_arrived": int(run.next),
            "num_requests_in_flight": len(in_flight), "num_requests": int(run.num_requests)}


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "total": 0.0}
    v = np.asarray(values)
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "total": float(v.sum())}


def _measured(engine: LLMEngine, step_times: list[float], computed: int, num_clipped: int) -> dict:
    """What the replay measured beside the tables: step times, forward tokens, pool and peak memory."""
    cuda = engine.device.type == "cuda"
    return {
        "device": str(engine.device), "backend": engine.model.attn_backend.name,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "step_time_s": _stats(step_times), "num_forward_tokens": int(computed),
        "kv_pool_bytes": int(engine.cache.bytes), "swap_pool_bytes": int(engine.cache.cpu_bytes),
        "weights_bytes": int(sum(p.numel() * p.element_size() for p in engine.model.parameters())),
        "torch_peak_bytes": int(torch.cuda.max_memory_allocated(engine.device)) if cuda else None,
        "process_peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
        "num_clipped_prompts": num_clipped,
    }
