"""One palette for every figure: each allocator and each memory state keeps its colour everywhere.

Allocators use Okabe-Ito and memory states Paul Tol's "bright" scheme; both are colour-blind safe and
the two families are kept apart so a bar segment is never mistaken for an allocator line.
"""
from __future__ import annotations

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.legend_handler import HandlerBase
from matplotlib.patches import Rectangle

from pagelab.run_format import HYBRID_STATES, MEMORY_STATES, SUB_STATES

ALLOCATOR_ORDER = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")

ALLOCATOR_COLORS = {
    "paged": "#0072B2",              # blue
    "contiguous-max": "#D55E00",     # vermillion
    # Not Okabe-Ito's orange: next to Max's vermillion the two read as one hue in a CDF.
    "contiguous-pow2": "#009E73",    # bluish green
    "contiguous-oracle": "#CC79A7",  # reddish purple
}
# Names outside the four known allocators (future policies) still get a stable, distinct colour.
_EXTRA_ALLOCATOR_COLORS = ("#E69F00", "#56B4E9", "#000000", "#F0E442")

# Allocators whose lines coincide (a run where memory never runs short) would hide all but the last one
# drawn: each line also carries its own marker, on every n-th point from an offset of its own, so the
# markers of coinciding lines alternate instead of stacking.
ALLOCATOR_MARKERS = {"paged": "o", "contiguous-max": "s", "contiguous-pow2": "^", "contiguous-oracle": "D"}
_EXTRA_ALLOCATOR_MARKERS = ("v", "P", "X", "*")
MARKERS_PER_LINE = 12
_MARKER_SIZES = {"^": 6.0, "v": 6.0, "D": 4.0, "s": 4.0}  # so that every marker covers about as much

ALLOCATOR_LABELS = {
    "paged": "paged (vLLM)",
    "contiguous-max": "contiguous (Max)",
    "contiguous-pow2": "contiguous (Pow2)",
    "contiguous-oracle": "contiguous (Oracle)",
}

STATE_ORDER = MEMORY_STATES  # bottom to top in every stacked figure (pagelab/run_format.py)
STATE_COLORS = dict(zip(STATE_ORDER, (
    "#228833",  # token states: green
    "#66CCEE",  # reservation: cyan
    "#EE6677",  # internal fragmentation: red
    "#CCBB44",  # external fragmentation: yellow
    "#DDDDDD",  # free: light grey
), strict=True))
STATE_LABELS = {s: s.replace("_", " ") for s in STATE_ORDER}

# What a pool split into KV cache groups wastes (pagelab/run_format.py HYBRID_STATES), drawn inside the
# state it is part of: that state's colour, hatched in a darker shade of its hue, so the state still reads
# as one. Only runs that carry the columns draw them (and name them in the legend).
PART_STATES = HYBRID_STATES


def _drawn_in(part: str) -> str:
    """The state whose band or bar holds `part` (window_cached is part of cached_free, part of free)."""
    parent = SUB_STATES[part]
    return parent if parent in MEMORY_STATES else _drawn_in(parent)


PART_OF = {p: _drawn_in(p) for p in PART_STATES}
PART_HATCH = {"padding": "////", "window_cached": "...."}
PART_HATCH_COLORS = {"padding": "#A8323F", "window_cached": "#7F7F7F"}
PART_LABELS = {"padding": "padding layers", "window_cached": "window blocks kept for prefix caching"}

# Queue lines share panels with no state colour, but their legend sits next to the states' one: Tol's
# blue and purple plus black, never a state's colour.
QUEUE_COLORS = {"num_running": "#4477AA", "num_waiting": "#AA3377", "num_swapped": "#000000"}
QUEUE_LINESTYLES = {"num_running": "-", "num_waiting": "-", "num_swapped": "--"}
QUEUE_LABELS = {"num_running": "running", "num_waiting": "waiting", "num_swapped": "swapped"}

# Block maps and snapshots colour thousands of requests; these only need to tell neighbours apart, and
# must never read as a memory state: every one is a blue (hue 200-245, darker than the reservation cyan),
# at least 35 CIELAB units from each state colour, white and grey (tests/viz/test_viz_palette.py).
OWNER_COLORS = (
    "#0A0A3D", "#101065", "#17375E", "#221BA7", "#2424DB", "#4742AE",
    "#494C88", "#39566A", "#2452DB", "#246DDB", "#5978A6", "#2489DB",
)
OWNER_FAMILY = "blues"  # how the legends name the request colours
FREE_RGB = (1.0, 1.0, 1.0)
OUTSIDE_POOL_RGB = (0.85, 0.85, 0.85)

LINESTYLES = ("-", "--", ":", "-.")
_OWNER_STRIDE = 5
OWNER_STRIDE = _OWNER_STRIDE  # the run explorer's page colours owners with the same formula as owner_rgb

# A request's phases (the run explorer's lanes): waiting and decoding in the queue lines' colours, prefill a
# lighter blue between them; preemptions and swaps are black and orange marks (never a state's colour).
PHASE_COLORS = {"waiting": QUEUE_COLORS["num_waiting"], "prefill": "#77AADD",
                "decode": QUEUE_COLORS["num_running"], "preempted": "#000000", "swapped_out": "#EE7733",
                "swapped_in": "#EE7733"}
# Shared blocks are hatched: pattern for ref count 2 and for 3 or more.
SHARED_HATCH = {2: "////", 3: "xxxx"}


def allocator_color(name: str) -> str:
    """The fixed colour of an allocator (unknown names get a stable extra colour)."""
    if name in ALLOCATOR_COLORS:
        return ALLOCATOR_COLORS[name]
    index = sum(name.encode()) % len(_EXTRA_ALLOCATOR_COLORS)
    return _EXTRA_ALLOCATOR_COLORS[index]


def allocator_marker(name: str, num_points: int) -> dict:
    """Line2D keywords that mark about MARKERS_PER_LINE of a line's `num_points` points in the allocator's
    marker; the four known allocators never mark the same point (names outside them may share one)."""
    slots = len(ALLOCATOR_ORDER)
    if name in ALLOCATOR_MARKERS:
        marker, k = ALLOCATOR_MARKERS[name], ALLOCATOR_ORDER.index(name)
    else:
        k = sum(name.encode()) % len(_EXTRA_ALLOCATOR_MARKERS)
        marker = _EXTRA_ALLOCATOR_MARKERS[k]
    step = slots * max(1, round(num_points / (slots * MARKERS_PER_LINE)))
    return {"marker": marker, "markersize": _MARKER_SIZES.get(marker, 4.5), "markeredgecolor": "white",
            "markeredgewidth": 0.5, "markevery": (k * step // slots, step)}


def allocator_label(name: str) -> str:
    """Human-readable allocator name for legends and tick labels."""
    return ALLOCATOR_LABELS.get(name, name)


def allocator_sort_key(name: str) -> tuple[int, str]:
    """Sort allocators paged first, then Max, Pow2, Oracle, then anything else by name."""
    if name in ALLOCATOR_ORDER:
        return (ALLOCATOR_ORDER.index(name), name)
    return (len(ALLOCATOR_ORDER), name)


def owner_rgb(request_ids: np.ndarray) -> np.ndarray:
    """RGB rows (float, 0-1) for request ids; any len(OWNER_COLORS) consecutive ids get distinct colours."""
    table = np.array([to_rgb(c) for c in OWNER_COLORS])
    # Stepping through the table by a stride coprime with its length spreads neighbours apart.
    index = (np.asarray(request_ids, dtype=np.int64) * _OWNER_STRIDE) % len(OWNER_COLORS)
    return table[index]


class OwnerSwatch:
    """A legend handle standing for "one shade per request", drawn as stripes of three request shades."""


class _OwnerStripes(HandlerBase):
    """Draws an OwnerSwatch in a legend."""

    def create_artists(self, legend, orig_handle, xdescent, ydescent, width, height, fontsize, trans):
        """Three stripes, each a request shade, filling the legend's swatch box."""
        third = width / 3
        return [Rectangle((-xdescent + i * third, -ydescent), third, height, facecolor=OWNER_COLORS[k],
                          edgecolor="none", transform=trans) for i, k in enumerate((1, 4, 10))]


OWNER_LEGEND = {OwnerSwatch: _OwnerStripes()}  # handler_map entry of every legend that shows requests


def part_style(part: str) -> dict:
    """Patch keywords that draw `part` (a PART_STATES name) inside its state: the state's colour, hatched."""
    return {"facecolor": STATE_COLORS[PART_OF[part]], "hatch": PART_HATCH[part],
            "hatchcolor": PART_HATCH_COLORS[part]}
