"""pagelab traces: the canonical trace table, loaders for public formats, synthetic generators.

The simulator and the engine code against the frame returned by `load_trace` / `validate_trace` /
`generate_trace`; see docs/traces.md for its columns and for which bad inputs are fixed or refused.
The names below load their module when first used, so importing one submodule (a simulation reading its
trace in batches) does not load the loaders and generators.
"""
from importlib import import_module

_WHERE = {
    "PagelabError": "pagelab.errors", "TraceError": "traces.errors",
    **dict.fromkeys(("BUNDLED", "FORMATS", "default_trace_path", "detect_format", "load_length_pairs",
                     "load_trace", "save_trace"), "traces.loaders"),
    **dict.fromkeys(("CANONICAL_COLUMNS", "PREFIX_COLUMNS", "TraceWarning", "validate_trace"),
                    "traces.schema"),
    **dict.fromkeys(("SyntheticConfig", "generate_trace", "rescale_rate", "respace_arrivals"),
                    "traces.synthetic"),
    **dict.fromkeys(("MultiTurnConfig", "generate_multiturn"), "traces.multiturn"),
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'traces' has no attribute {name!r}")


__all__ = sorted(_WHERE)
