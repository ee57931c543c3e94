"""Typed error for unreadable or malformed run folders and tables handed to the figures."""


class VizError(ValueError):
    """A run folder or table cannot be plotted; the message names the file and the column or key."""
