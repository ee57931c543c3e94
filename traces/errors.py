"""Trace errors (the base class lives in pagelab.errors, shared by every package)."""
from pagelab.errors import PagelabError


class TraceError(PagelabError, ValueError):
    """A trace file or trace table is malformed; the message names the file, row and field."""
