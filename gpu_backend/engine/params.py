"""What a caller hands the engine (SamplingParams) and what it gets back (RequestOutput), vLLM-style."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagelab.errors import PagelabError


class EngineInputError(PagelabError, ValueError):
    """A request or engine option the engine cannot serve; the message names the request and field."""

    names_fields = True


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request.

    temperature 0 is greedy; top_k <= 0 and top_p 1.0 disable those filters. `n` independent samples
    share the prompt's KV blocks. Setting `beam_width` (1 included) runs beam search instead of sampling:
    scores are sums of log-probs and the `beam_width` best sequences come back best first. `ignore_eos`
    keeps generating past EOS, so every sample has exactly `max_tokens` tokens. `seed` makes sampling
    reproducible independently of the batch (sample j of a request draws from its own generator, seeded
    by (seed, j)).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    beam_width: int | None = None
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = (
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.beam_width is None or self.beam_width >= 1,
             f"beam_width must be >= 1, got {self.beam_width}"),
            (self.beam_width is None or self.n == 1,
             f"beam search returns beam_width sequences; use n=1 with beam_width={self.beam_width}"),
        )
        for ok, message in checks:
            if not ok:
                raise EngineInputError(f"SamplingParams: {message}")

    @property
    def width(self) -> int:
        """Sequences the request runs at once (beams or parallel samples)."""
        return self.n if self.beam_width is None else self.beam_width

    @property
    def use_beam_search(self) -> bool:
        """Whether the request runs beam search."""
        return self.beam_width is not None


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    token_ids: list[int]
    cumulative_logprob: float | None = None  # beam search only: the beam's score
    finish_reason: str = "length"  # "length" (max_tokens), "stop" (EOS) or "rejected"


@dataclass
class RequestOutput:
    """A finished request: its prompt and its `n` samples (or `beam_width` beams, best first)."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
