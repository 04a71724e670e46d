"""Parse a memory budget: a fraction of the plain step's activation peak, or bytes."""

from __future__ import annotations

import math
import numbers
import re

from ..errors import RematError

__all__: list[str] = []

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_TEXT = re.compile(
    r"^\s*(-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([a-z%]*)\s*$", re.IGNORECASE
)

_HOW = (
    'give a fraction of the plain step\'s activation peak ("50%", 0.5) or bytes '
    '(600 * 2**20, "600MiB", "1.5GiB")'
)


def parse_budget(budget: object, plain_peak: int) -> int:
    """The budget in bytes: ``"50%"`` and floats in (0, 1] are fractions of ``plain_peak``;
    ints and texts with a unit (``"1.5GiB"``) are bytes."""
    if isinstance(budget, bool) or budget is None:
        raise RematError(f"remat.plan: budget must be a fraction or bytes, got {budget!r}; {_HOW}.")
    if isinstance(budget, numbers.Integral):  # int, numpy's integers
        if budget <= 0:
            raise RematError(f"remat.plan: budget must be positive, got {budget} bytes; {_HOW}.")
        return int(budget)
    if isinstance(budget, numbers.Real):  # float, numpy's floats
        budget = float(budget)
        if not 0.0 < budget <= 1.0:
            raise RematError(
                f"remat.plan: a float budget is a fraction of the plain step's peak in (0, 1], "
                f"got {budget!r}; {_HOW}."
            )
        return int(budget * plain_peak)
    if isinstance(budget, str):
        match = _TEXT.match(budget)
        if match is not None:
            value, unit = float(match.group(1)), match.group(2).lower()
            if unit == "%":
                if 0.0 < value <= 100.0:
                    return int(value / 100.0 * plain_peak)
                raise RematError(
                    f"remat.plan: a budget in percent must lie in (0%, 100%] of the plain "
                    f"step's activation peak (the plain step fits 100%), got {budget!r}; give "
                    'a share such as "50%", or bytes ("600MiB").'
                )
            elif unit in _UNITS and value > 0:
                nbytes = value * _UNITS[unit]
                if not math.isfinite(nbytes):
                    raise RematError(
                        f"remat.plan: the budget {budget!r} is too large to be read; {_HOW}."
                    )
                if nbytes < 1:
                    bare = " (a number without a unit is bytes)" if not unit else ""
                    raise RematError(
                        f"remat.plan: the budget {budget!r} is less than one byte{bare}; {_HOW}."
                    )
                return int(nbytes)
            elif unit in _UNITS:  # zero or negative
                raise RematError(f"remat.plan: budget must be positive, got {budget!r}; {_HOW}.")
        raise RematError(f"remat.plan: cannot read the budget {budget!r}; {_HOW}.")
    raise RematError(
        f"remat.plan: budget must be a fraction or bytes, got {type(budget).__name__}; {_HOW}."
    )


def fmt_bytes(n: float) -> str:
    """``n`` bytes in MiB with one decimal, for summaries; KiB below 0.1 MiB."""
    if abs(n) < 0.1 * 2**20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**20:,.1f} MiB"
