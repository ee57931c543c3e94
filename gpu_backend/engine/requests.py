"""Per-request state of the engine: sampling settings, per-sequence seeds, beams, and the final output."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gpu_backend.engine.beam_search import BeamState, Hypothesis
from gpu_backend.engine.params import CompletionOutput, EngineInputError, RequestOutput, SamplingParams
from simulator.core.sequence import Sequence, SequenceGroup


def check_prompt(prompt, vocab_size: int, where: str) -> list[int]:
    """A prompt as a list of ints in [0, vocab_size), or EngineInputError naming `where`."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
        raise EngineInputError(f"{where}: a prompt is a list of token ids, got {type(prompt).__name__}")
    tokens = [int(t) for t in prompt]
    if not tokens:
        raise EngineInputError(f"{where}: empty prompt")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise EngineInputError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return tokens


def sequence_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a seeded request (independent of batch, request id and other samples)."""
    return int(np.random.SeedSequence([int(seed), index]).generate_state(1)[0])


@dataclass
class RequestState:
    """What the engine keeps for one request while it runs."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    group: SequenceGroup
    seeds: dict[int, int] = field(default_factory=dict)  # by seq id: its sampling seed, -1 for none
    beam: BeamState | None = None
    samples: list[Sequence] = field(default_factory=list)  # n > 1: the samples in output order
    finish_reasons: dict[int, str] = field(default_factory=dict)  # by seq id
    beam_result: list[Hypothesis] | None = None
    num_sampling_steps: int = 0

    @classmethod
    def create(cls, request_id: int, prompt: list[int], params: SamplingParams, seq_ids: list[int],
               arrival_s: float) -> RequestState:
        """A fresh request: its sequence group (width sequences sharing the prompt) and their seeds."""
        final_len = len(prompt) + params.max_tokens - 1  # the last sampled token never gets a slot
        seqs = [Sequence(i, len(prompt), final_len, request_id=request_id, token_ids=list(prompt))
                for i in seq_ids]
        group = SequenceGroup(request_id, seqs, arrival_s, n=params.n, beam_width=params.beam_width or 1)
        state = cls(request_id, list(prompt), params, group, samples=list(seqs))
        if params.use_beam_search:
            state.beam = BeamState(params.beam_width, len(prompt))
        seeded = params.seed is not None and params.temperature > 0
        for j, s in enumerate(seqs):
            state.seeds[s.seq_id] = sequence_seed(params.seed, j) if seeded else -1
        return state

    def output(self, eos: set[int]) -> RequestOutput:
        """The finished request as vLLM would return it (`eos`: the model's end-of-sequence ids)."""
        if self.beam is not None:
            stops = set() if self.params.ignore_eos else eos
            outs = [CompletionOutput(i, tokens, score, "stop" if tokens and tokens[-1] in stops else "length")
                    for i, (score, tokens) in enumerate(self.beam_result or [])]
        else:
            outs = [CompletionOutput(j, list(s.token_ids[len(self.prompt):]), None,
                                     self.finish_reasons.get(s.seq_id, "length"))
                    for j, s in enumerate(self.samples)]
        return RequestOutput(self.request_id, list(self.prompt), outs, True)

    def rejected_output(self) -> RequestOutput:
        """The output of a request the scheduler refused (it can never fit)."""
        outs = [CompletionOutput(j, [], None, "rejected") for j in range(self.params.width)]
        return RequestOutput(self.request_id, list(self.prompt), outs, True)
