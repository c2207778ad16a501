"""Which training steps to trace: ``"0-9"``, ``"5"``, ``"every:100"``, or a comma list."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class StepSpecError(ValueError):
    pass


@dataclass(frozen=True)
class StepSelection:
    """A set of step indices; ``None`` spec means every step."""

    ranges: tuple[tuple[int, int | None], ...] = ()  # inclusive bounds, None = open end
    every: tuple[int, ...] = ()
    all_steps: bool = False
    text: str = field(default="all", compare=False)

    def __contains__(self, step: int) -> bool:
        if self.all_steps:
            return True
        for lo, hi in self.ranges:
            if step >= lo and (hi is None or step <= hi):
                return True
        return any(step % n == 0 for n in self.every)

    def last(self) -> int | None:
        """The last selected step, or None when the selection never ends."""
        if self.all_steps or self.every or any(hi is None for _, hi in self.ranges):
            return None
        return max((hi for _, hi in self.ranges if hi is not None), default=None)


ALL_STEPS = StepSelection(all_steps=True)


def parse_steps(spec: str | int | None) -> StepSelection:
    """Parse a step spec; raises StepSpecError with a one-line message on bad input."""
    if spec is None or spec == "all":
        return ALL_STEPS
    if isinstance(spec, int):
        spec = str(spec)
    ranges: list[tuple[int, int | None]] = []
    every: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        try:
            if part.startswith("every:"):
                n = int(part[6:])
                if n <= 0:
                    raise ValueError
                every.append(n)
            elif "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo = int(lo_s)
                hi = int(hi_s) if hi_s else None
                if lo < 0 or (hi is not None and hi < lo):
                    raise ValueError
                ranges.append((lo, hi))
            else:
                n = int(part)
                if n < 0:
                    raise ValueError
                ranges.append((n, n))
        except ValueError:
            raise StepSpecError(
                f"bad step spec {part!r} in {spec!r}: use N, A-B, A-, every:N or a comma list"
            ) from None
    return StepSelection(tuple(ranges), tuple(every), False, spec)


@dataclass(frozen=True)
class WatchSpec:
    """A parsed ``--watch`` spec: the gradient norm limit (or None), whether loss spikes are
    caught too, and the spike watch's settings given in the spec (``spike:sigmas=8``)."""

    gradnorm: float | None = None
    spike: bool = False
    spike_settings: tuple[tuple[str, float], ...] = ()

    def spike_kwargs(self) -> dict[str, Any]:
        """The spike settings as ``Spikes``' keyword arguments (``window=64``)."""
        return {SPIKE_SETTINGS[k][0]: v for k, v in self.spike_settings}


# The spike watch's settings in a --watch spec (``spike:sigmas=6,window=128,warmup=8``):
# name -> (Spikes' argument, whole number, default; tracer/watch/spikes.py says what each is).
SPIKE_SETTINGS: dict[str, tuple[str, bool, float]] = {
    "sigmas": ("sigmas", False, 6.0),
    "ratio": ("min_ratio", False, 2.0),
    "grad_ratio": ("grad_ratio", False, 10.0),
    "window": ("window", True, 128),
    "warmup": ("warmup", True, 8),
    "lasting": ("lasting", True, 16),
}


def parse_watch(spec: str) -> float | None:
    """``--watch`` spec's gradient norm limit (see :func:`parse_watch_spec`), or None."""
    return parse_watch_spec(spec).gradnorm


def parse_watch_spec(spec: str) -> WatchSpec:
    """``--watch`` spec: ``nan`` (NaN/Inf in the gradients or the loss), ``gradnorm:X`` (that,
    and a total gradient norm above X), ``spike`` (that, and a loss spike: the loss or the
    gradient norm far above the run's recent steps), joined by ``,``. The spike watch's
    settings follow it as ``NAME=VALUE`` parts: ``spike:sigmas=6,window=128,warmup=8``
    (:data:`SPIKE_SETTINGS`). Raises StepSpecError with a one-line message on bad input."""
    gradnorm = None
    spike = False
    settings: dict[str, float] = {}
    for part in (p.strip() for p in str(spec).split(",")):
        if part == "nan":
            continue
        if part == "spike" or part.startswith("spike:"):
            spike = True
            part = part[6:].strip()
            if not part:
                continue
        if "=" in part:
            if not spike:
                raise StepSpecError(f"bad watch {part!r}: settings follow spike (spike:{part})")
            name, value = _spike_setting(part)
            settings[name] = value
            continue
        if part.startswith("gradnorm:"):
            try:
                gradnorm = float(part[9:])
            except ValueError:
                gradnorm = None
            if gradnorm is None or not gradnorm > 0 or gradnorm != gradnorm:
                raise StepSpecError(f"bad watch {part!r}: gradnorm:X needs a number above 0")
            continue
        where = "" if part == str(spec).strip() else f" in {spec!r}"  # said once, not twice
        raise StepSpecError(f"bad watch {part!r}{where}: use nan, gradnorm:X, spike or a list")
    window = settings.get("window", SPIKE_SETTINGS["window"][2])
    warmup = settings.get("warmup", SPIKE_SETTINGS["warmup"][2])
    if not 2 <= warmup <= window:
        raise StepSpecError(f"bad watch {spec!r}: the spike watch needs 2 <= warmup <= window")
    return WatchSpec(gradnorm, spike, tuple(settings.items()))


def _spike_setting(part: str) -> tuple[str, float]:
    name, _, text = (s.strip() for s in part.partition("="))
    known = SPIKE_SETTINGS.get(name)
    if known is None:
        raise StepSpecError(
            f"bad watch setting {part!r}: the spike watch takes {', '.join(SPIKE_SETTINGS)}"
        )
    _, whole, _ = known
    try:
        value = float(int(text)) if whole else float(text)
    except ValueError:
        value = float("nan")
    if name == "sigmas":
        ok, need = value > 0, "a number above 0"
    else:
        low = 1 if name in ("ratio", "grad_ratio", "lasting") else 2
        ok, need = value >= low, f"{'a whole number' if whole else 'a number'} >= {low}"
    if not ok:
        raise StepSpecError(f"bad watch setting {part!r}: {name} needs {need}")
    return name, int(value) if whole else value
