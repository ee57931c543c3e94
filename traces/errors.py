"""Trace errors (the base class lives in pagelab.errors, shared by every package)."""
from pagelab.errors import PagelabError


class TraceError(PagelabError, ValueError):
    """A trace file or trace table is malformed; the message names the file, row and field."""


class TraceFieldError(TraceError):
    """A generator's setting is impossible; `field` names it, so a caller can name its own option."""

    def __init__(self, kind: str, field: str, problem: str, value: object) -> None:
        super().__init__(f"{kind}, field '{field}': {problem} (got {value!r})")
        self.field, self.problem, self.value = field, problem, value
