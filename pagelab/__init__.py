"""Project-wide basics every package may import: the version, the user-error base class, atomic writes."""
from pagelab.errors import PagelabError

__version__ = "0.2.0"

__all__ = ["PagelabError", "__version__"]
