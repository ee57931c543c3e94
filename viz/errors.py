"""Typed error for unreadable or malformed run folders and tables handed to the figures."""
from pagelab.errors import PagelabError


class VizError(PagelabError, ValueError):
    """A run folder or table cannot be plotted; the message names the file and the column or key."""
