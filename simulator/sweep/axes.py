"""Sweep axes: parse rate ranges and value lists, and expand them into configurations and points.

A *configuration* is one value of every axis except the rate; a *point* is a configuration at one rate.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from pagelab.errors import PagelabError
from pagelab.run_format import sweep_axis_applies
from simulator.config import SimConfig

# Axes the sweep itself owns (or that would make a point meaningless to vary).
RESERVED = ("rate", "allocator", "extra", "record_events")
RATE_DIGITS = 9  # rates are rounded so 0.1 + 0.2 style sums hash and print the same every time


class SweepError(PagelabError):
    """A sweep was asked for something impossible (bad range, unknown axis, unreachable cluster)."""


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SweepError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise SweepError(f"{what}: {text!r} is not a finite number")
    return value


def _check_kept(spec: str, rate: float) -> None:
    """Refuse a rate that its RATE_DIGITS decimals round to 0 requests/s."""
    if round(rate, RATE_DIGITS) <= 0:
        raise SweepError(f"--rate {spec!r}: rates are kept to {RATE_DIGITS} decimals, so {rate:g} "
                         f"requests/s would be 0; the lowest rate is {10.0 ** -RATE_DIGITS:g}")


def parse_rates(spec: str) -> tuple[tuple[float, ...], tuple[float, float]]:
    """Parse `--rate`: 'START:STOP:STEP' (inclusive grid), 'START:STOP' (search bounds only) or 'A,B,C'.

    Returns the grid rates (possibly just the two bounds) and the (low, high) bounds of the search.
    """
    text = spec.strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise SweepError(f"--rate {spec!r}: use START:STOP:STEP, START:STOP or a comma-separated list")
        start, stop = (_number(p, f"--rate {spec!r}") for p in parts[:2])
        if start <= 0:
            raise SweepError(f"--rate {spec!r}: rates must be > 0 requests/s")
        _check_kept(spec, start)
        if stop <= start:
            raise SweepError(f"--rate {spec!r}: the range is empty or inverted (STOP must exceed START)")
        if len(parts) == 2:
            return (round(start, RATE_DIGITS), round(stop, RATE_DIGITS)), (start, stop)
        step = _number(parts[2], f"--rate {spec!r}")
        if step <= 0:
            raise SweepError(f"--rate {spec!r}: STEP must be > 0")
        if step > stop - start + 1e-9:
            raise SweepError(f"--rate {spec!r}: STEP is larger than STOP - START, so the grid would hold "
                             "START alone; give a smaller STEP, or START:STOP to search between the two")
        count = math.floor((stop - start) / step + 1e-9) + 1
        if count > 10_000:
            raise SweepError(f"--rate {spec!r}: {count} rates is too many (at most 10000)")
        rates = tuple(round(start + i * step, RATE_DIGITS) for i in range(count))
        return rates, (rates[0], rates[-1])
    values = parse_axis_values("rate", text, float, what=f"--rate {spec!r}")
    if any(v <= 0 for v in values):
        raise SweepError(f"--rate {spec!r}: rates must be > 0 requests/s")
    _check_kept(spec, min(values))
    rates = tuple(sorted({round(v, RATE_DIGITS) for v in values}))
    return rates, (rates[0], rates[-1])


def _convert(what: str, text: str, kind: type):
    """One axis value from text, typed like the SimConfig field it sets; errors start with `what`."""
    if kind is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise SweepError(f"{what}: {text!r} is not true/false")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise SweepError(f"{what}: {text!r} is not an integer") from None
    if kind is float:
        return _number(text, what)
    return text


def parse_axis_values(name: str, text: str, kind: type, what: str | None = None) -> tuple:
    """A comma-separated list of values (order kept, duplicates dropped); empty lists are refused.

    `what` starts the error messages: the option the values came from (default: "axis NAME").
    """
    what = what or f"axis {name}"
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise SweepError(f"{what}: empty value in {text!r}")
    return tuple(dict.fromkeys(_convert(what, t, kind) for t in items))


def _field_types() -> dict[str, type]:
    """SimConfig field name -> the Python type of its values (from the default, or the annotation)."""
    out = {}
    for f in dataclasses.fields(SimConfig):
        if f.name in RESERVED:
            continue
        default = f.default
        if isinstance(default, (bool, int, float, str)):
            out[f.name] = type(default)
        else:  # Optional fields default to None: read the annotation ("int | None", "float | None")
            out[f.name] = int if "int" in str(f.type) else float if "float" in str(f.type) else str
    return out


def parse_axis(spec: str) -> tuple[str, tuple]:
    """Parse `--axis NAME=V1,V2,...` for any SimConfig field (e.g. max_num_seqs=128,256)."""
    name, sep, values = spec.partition("=")
    name = name.strip().replace("-", "_")
    if not sep:
        raise SweepError(f"--axis {spec!r}: use NAME=V1,V2,...")
    types = _field_types()
    if name not in types:
        hint = "use --rate / -a for it" if name in ("rate", "allocator") else \
            f"choose from {', '.join(sorted(types))}"
        raise SweepError(f"--axis {spec!r}: unknown axis {name!r}; {hint}")
    return name, parse_axis_values(name, values, types[name])


@dataclass(frozen=True)
class SweepAxes:
    """The values of every swept axis; `base` holds the options shared by all points."""

    rates: tuple[float, ...]
    bounds: tuple[float, float]
    allocators: tuple[str, ...]
    axes: dict[str, tuple] = field(default_factory=dict)  # SimConfig field -> values (beyond allocator)
    base: dict = field(default_factory=dict)  # SimConfig keyword arguments shared by every point

    def configs(self) -> list[dict]:
        """Every configuration (axis name -> value, allocator included), axes in a fixed order."""
        names = list(self.axes)
        out = []
        for allocator in self.allocators:
            values = [self.axes[n] if sweep_axis_applies(n, allocator) else self.axes[n][:1] for n in names]
            for combo in itertools.product(*values):
                out.append({"allocator": allocator, **dict(zip(names, combo, strict=True))})
        return out

    def sim_config(self, config: dict) -> SimConfig:
        """The SimConfig of one configuration (raises SweepError when the combination is invalid)."""
        try:
            events = self.base.get("record_events", False)
            return SimConfig(**{**self.base, **config, "record_events": events})
        except PagelabError as exc:
            raise SweepError(f"configuration {config_label(config)}: {exc}") from None

    def check(self) -> None:
        """Validate every configuration up front so a sweep never fails half-way on a bad combination."""
        from simulator.presets import get_gpu
        from simulator.timing.step_latency import check_latency

        for config in self.configs():
            sim = self.sim_config(config)
            try:  # presets are looked up lazily by the simulator; look them up now
                get_gpu(sim.gpu)
                sim.model_spec  # noqa: B018
                sim.check_runnable()
                check_latency(sim.latency, sim.model_spec, sim.gpu)
            except PagelabError as exc:
                raise SweepError(f"configuration {config_label(config)}: {exc}") from None


def labelled_axes(config: dict) -> dict:
    """The axes a label names: those that apply to its allocator (which is left out)."""
    allocator = config["allocator"]
    return {k: v for k, v in config.items() if k != "allocator" and sweep_axis_applies(k, allocator)}


def config_label(config: dict) -> str:
    """A short human label: 'paged bs=16 kv_memory_gb=12'."""
    parts = [str(config["allocator"])]
    parts += [f"{short_name(k)}={v}" for k, v in labelled_axes(config).items()]
    return " ".join(parts)


def short_name(axis: str) -> str:
    """Abbreviations used in labels and folder names."""
    return {"block_size": "bs", "kv_memory_gb": "kv", "max_num_seqs": "seqs"}.get(axis, axis)
