"""Seeded multi-turn conversation traces whose prefix keys let the prefix cache see the history they reuse.

A conversation is a system prompt shared by every conversation, then turns. Turn t's prompt is the whole
history (turn t-1's prompt, its answer) plus a new user message, so it extends the last prompt plus
answer, as the chat turns of the Mooncake conversation trace do. Turn t+1 arrives a think time after turn t
(the think time stands for the answer's latency plus the user's pause; a trace does not know the latency).

Keys are recorded as in the Mooncake traces (`hash_ids`): one key per `prefix_block_size` tokens of the
prompt, the last block possibly partial. A key stands for the prompt up to the end of its block, so a full
block of a conversation's history keeps its key in every later turn, the system prompt's full blocks share
their keys across conversations, and a partial last block gets a key of its own (the next turn fills it with
other tokens).

The defaults reproduce the Mooncake conversation trace's mean prompt (12.0k tokens) and the share of its
prompt blocks that repeat an earlier block (37 %); docs/traces.md gives the measured values.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from traces.errors import TraceError, TraceFieldError
from traces.schema import bulk_objects, validate_trace

THINK_TIMES = ("exponential", "lognormal", "fixed")


@dataclass(frozen=True)
class MultiTurnConfig:
    """Everything that defines a multi-turn trace; lengths are means of lognormal draws (sigma below)."""

    num_requests: int = 1000  # turns over all conversations (the first to arrive)
    # Conversations start at rate / mean_turns per second, so requests come at `rate` per second in the
    # long run; a short trace's later turns are still waiting out think times, so it runs below `rate`.
    rate: float = 3.4
    mean_turns: float = 1.55  # turns per conversation: geometric with this mean
    system_prompt_len: int = 512  # shared by every conversation
    first_prompt_len: float = 11500.0  # the first user message (documents, code, context)
    user_len: float = 600.0  # each later user message
    output_len: float = 343.0  # each answer
    sigma: float = 1.1  # lognormal shape of the three lengths
    think_time_s: float = 60.0  # mean gap between a turn's arrival and the next turn's
    think_time: str = "exponential"  # exponential | lognormal (cv 1) | fixed
    max_model_len: int = 131072  # a conversation ends before a prompt + answer would exceed it
    prefix_block_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse impossible settings early, naming the field."""

        def bad(name: str, why: str) -> None:
            raise TraceFieldError("multi-turn trace", name, why, getattr(self, name))

        if self.num_requests < 1:
            bad("num_requests", "must be >= 1")
        for name in ("rate", "first_prompt_len", "user_len", "output_len", "sigma"):
            if not getattr(self, name) > 0:
                bad(name, "must be > 0")
        if not (self.mean_turns >= 1 and np.isfinite(self.mean_turns)):
            bad("mean_turns", "must be a finite number >= 1")
        if self.system_prompt_len < 0:
            bad("system_prompt_len", "must be >= 0")
        if not (self.think_time_s >= 0 and np.isfinite(self.think_time_s)):
            bad("think_time_s", "must be a finite number >= 0")
        if self.think_time not in THINK_TIMES:
            bad("think_time", f"must be one of {', '.join(THINK_TIMES)}")
        if self.prefix_block_size < 1:
            bad("prefix_block_size", "must be >= 1")
        if self.max_model_len < self.system_prompt_len + 2:
            bad("max_model_len", "leaves no room for a user message and an answer after the system prompt")


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    """Whole lengths >= 1 with the given mean."""
    mu = np.log(mean) - sigma**2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size))).astype(np.int64)


def _think(config: MultiTurnConfig, rng: np.random.Generator, size: int) -> np.ndarray:
    """Think times in seconds with mean think_time_s."""
    mean = config.think_time_s
    if config.think_time == "fixed" or mean == 0:
        return np.full(size, float(mean))
    if config.think_time == "exponential":
        return rng.exponential(mean, size)
    return rng.lognormal(np.log(mean) - np.log(2) / 2, np.sqrt(np.log(2)), size)  # cv 1


def generate_multiturn(config: MultiTurnConfig, *, warnings: list[str] | None = None) -> pd.DataFrame:
    """A canonical multi-turn trace with prefix keys (`prefix_blocks`, `prefix_block_size`)."""
    start_rng, turn_rng, length_rng, think_rng = np.random.default_rng(config.seed).spawn(4)
    # Turns past max_model_len are dropped, so more turns are drawn and the first num_requests to
    # arrive are kept.
    num = int(config.num_requests * 1.05) + 64
    turns = turn_rng.geometric(1 / config.mean_turns, int(num / config.mean_turns * 1.2) + 16)
    while turns.sum() < num:
        turns = np.concatenate((turns, turn_rng.geometric(1 / config.mean_turns, len(turns))))
    ends = np.cumsum(turns)
    nconv = int(np.searchsorted(ends, num)) + 1
    turns = turns[:nconv].copy()
    turns[-1] -= int(ends[nconv - 1]) - num
    conv = np.repeat(np.arange(nconv), turns)
    first = np.concatenate(([0], np.cumsum(turns)[:-1]))
    turn = np.arange(num) - np.repeat(first, turns)
    user = _lognormal(length_rng, config.user_len, config.sigma, num)
    user[first] = _lognormal(length_rng, config.first_prompt_len, config.sigma, nconv)
    output = _lognormal(length_rng, config.output_len, config.sigma, num)
    user[first] += config.system_prompt_len
    # prompt_t = prompt_{t-1} + output_{t-1} + user_t: a running sum inside each conv.
    grow = user + np.concatenate(([0], output[:-1]))
    grow[first] = user[first]
    total = np.cumsum(grow)
    prompt = total - np.repeat(total[first] - grow[first], turns)
    # A conv ends at its first turn that would not fit in max_model_len.
    fits = prompt + output <= config.max_model_len
    fits &= np.maximum.accumulate(np.where(fits, 0, conv + 1)) <= conv  # no earlier misfit
    gaps = _think(config, think_rng, num)
    gaps[first] = 0.0
    starts = np.cumsum(start_rng.exponential(config.mean_turns / config.rate, nconv))
    # Summed per conversation: a running sum over all conversations, less its value at each conversation's
    # start, cancels away the think times once that sum dwarfs them.
    since_start = pd.Series(gaps).groupby(conv, sort=False).cumsum().to_numpy()
    arrival = np.repeat(starts, turns) + since_start
    keep = np.flatnonzero(fits)
    if len(keep) == 0:
        raise TraceError(f"multi-turn trace: no first turn fits in max_model_len {config.max_model_len}")
    conv, turn, prompt, output, arrival = (a[keep] for a in (conv, turn, prompt, output, arrival))
    order = np.argsort(arrival, kind="stable")[:config.num_requests]
    conv, turn, prompt, output, arrival = (a[order] for a in (conv, turn, prompt, output, arrival))
    keys = _keys(config, conv, prompt)
    frame = pd.DataFrame({
        "request_id": np.arange(len(order), dtype=np.int64), "arrival_s": arrival - arrival[0],
        "prompt_len": prompt, "output_len": output,
        "n": np.ones(len(order), np.int64), "beam_width": np.ones(len(order), np.int64),
        "prefix_blocks": keys, "prefix_block_size": np.full(len(order), config.prefix_block_size, np.int64),
    })
    return validate_trace(frame, source="multi-turn trace", warnings=warnings)


def _keys(config: MultiTurnConfig, conversation: np.ndarray, prompt: np.ndarray) -> list[list[int]]:
    """Mooncake-style keys of every prompt: shared system blocks, per-conversation history blocks, and a key
    of its own for a partial last block."""
    size = config.prefix_block_size
    num_sys = config.system_prompt_len // size  # system blocks that are full, hence identical everywhere
    full = prompt // size
    partial = (prompt % size) > 0
    nkeys = full + partial
    # Conversation s's history block j (j >= num_sys) has key base[s] + j; partial blocks come after them all.
    span = np.zeros(int(conversation.max()) + 1, np.int64)
    np.maximum.at(span, conversation, full)
    base = np.concatenate(([0], np.cumsum(span)[:-1])) + num_sys
    pos = np.arange(int(nkeys.sum())) - np.repeat(np.cumsum(nkeys) - nkeys, nkeys)
    owner = np.repeat(np.arange(len(prompt)), nkeys)
    flat = np.where(pos < num_sys, pos, base[conversation[owner]] + pos)
    last_partial = partial[owner] & (pos == nkeys[owner] - 1)
    fresh = int(base[-1] + span[-1]) + np.arange(int(last_partial.sum()))
    flat[last_partial] = fresh
    flat = flat.tolist()
    bounds = np.cumsum(nkeys).tolist()
    with bulk_objects():
        return [flat[a:b] for a, b in zip([0, *bounds[:-1]], bounds, strict=True)]
