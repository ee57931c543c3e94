"""The base class of every error caused by the user's input or configuration (the CLI prints these)."""


class PagelabError(Exception):
    """Base class for errors caused by the user's input or configuration."""

    names_fields = False  # whether the message names configuration fields (the CLI shows its options)
