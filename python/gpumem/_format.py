"""Byte counts as text, in binary units: the one formatter every view, report and log line uses.

    >>> fmt_bytes(3 << 30), fmt_bytes(200 << 20), fmt_bytes(1023), fmt_bytes(5 << 20, signed=True)
    ('3.00 GiB', '200 MiB', '1023 B', '+5.00 MiB')
    >>> fmt_bytes(35 << 30, unit="GiB"), fmt_in(3 << 29, "GiB", digits=3), unit_for(3 << 20)
    ('35.00 GiB', '1.500', 'MiB')
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["UNIT_BYTES", "fmt_bytes", "fmt_in", "unit_for"]

UNIT_BYTES = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50}
_UNITS = tuple(UNIT_BYTES)


def unit_for(n: float, largest: str = "PiB") -> str:
    """The largest binary unit that ``n`` bytes reach (``"B"`` below 1 KiB), at most ``largest``."""
    best = "B"
    for unit in _UNITS[: _UNITS.index(largest) + 1]:
        if n >= UNIT_BYTES[unit]:
            best = unit
    return best


def fmt_in(n: float, unit: str, digits: int = 2) -> str:
    """The number alone, ``n`` bytes in ``unit`` with ``digits`` decimals (for table columns)."""
    return f"{n / UNIT_BYTES[unit]:.{digits}f}"


def fmt_bytes(n: Any, signed: bool = False, unit: Optional[str] = None, digits: Optional[int] = None) -> str:
    """A byte count with its unit: ``fmt_bytes(3 << 30) == '3.00 GiB'``.

    Without ``unit``, the largest unit the count reaches, with 3 significant digits (2 decimals below
    10, 1 below 100, none above; whole bytes below 1 KiB).  With ``unit`` (``"GiB"``), always that
    unit, with ``digits`` decimals (default 2).  ``signed`` puts ``+`` before positive counts; ``None``
    is ``"?"``; anything that is not a number is returned as ``str()``.
    """
    if n is None:
        return "?"
    if unit is not None:
        try:
            v = float(n)
        except Exception:
            return str(n)
        sign = "+" if signed and v > 0 else ""
        return f"{sign}{fmt_in(v, unit, 2 if digits is None else digits)} {unit}"
    try:
        n = int(n)
    except Exception:
        return str(n)
    sign = ""
    if n < 0:
        sign, n = "-", -n
    elif signed and n > 0:
        sign = "+"
    if n < 1024:
        return f"{sign}{n} B"
    unit = unit_for(n)
    v = n / UNIT_BYTES[unit]
    if digits is None:
        digits = 2 if v < 10 else (1 if v < 100 else 0)
    return f"{sign}{v:.{digits}f} {unit}"
