"""Typed error for unreadable or malformed run folders and tables handed to the figures."""
from pathlib import Path

from pagelab.errors import PagelabError


class VizError(PagelabError, ValueError):
    """A run folder or table cannot be plotted; the message names the file and the column or key."""


class TableError(VizError):
    """A table file that cannot be read (missing, cut short, not Parquet/CSV); the message names the file."""

    def __init__(self, message: str, path: Path, table: str) -> None:
        super().__init__(message)
        self.path = path  # the file (or part file) that cannot be read
        self.table = table  # requests, memory, events or steps
