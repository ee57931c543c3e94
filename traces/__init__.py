"""pagelab traces: the canonical trace table, loaders for public formats, synthetic generators.

The simulator and the engine code against the frame returned by `load_trace` / `validate_trace` /
`generate_trace`; see docs/traces.md for its columns and for which bad inputs are fixed or refused.
"""
from pagelab.errors import PagelabError
from traces.errors import TraceError
from traces.loaders import (
    BUNDLED,
    FORMATS,
    default_trace_path,
    detect_format,
    load_length_pairs,
    load_trace,
    save_trace,
)
from traces.schema import CANONICAL_COLUMNS, PREFIX_COLUMNS, TraceWarning, validate_trace
from traces.synthetic import SyntheticConfig, generate_trace, rescale_rate, respace_arrivals

__all__ = [
    "BUNDLED",
    "CANONICAL_COLUMNS",
    "FORMATS",
    "PREFIX_COLUMNS",
    "PagelabError",
    "SyntheticConfig",
    "TraceError",
    "TraceWarning",
    "default_trace_path",
    "detect_format",
    "generate_trace",
    "load_length_pairs",
    "load_trace",
    "rescale_rate",
    "respace_arrivals",
    "save_trace",
    "validate_trace",
]
