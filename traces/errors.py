"""Error types shared by the whole project (traces sits at the bottom of the import graph)."""


class PagelabError(Exception):
    """Base class for errors caused by the user's input or configuration."""


class TraceError(PagelabError, ValueError):
    """A trace file or trace table is malformed; the message names the file, row and field."""
