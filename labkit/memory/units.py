"""Byte units: binary (GiB = 2**30) everywhere, because that is what devices and allocators report."""

from __future__ import annotations

KiB, MiB, GiB = 2**10, 2**20, 2**30


def fmt_bytes(n: float, digits: int = 2) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str | float | int) -> int:
    """'8GiB', '8 GB' (read as GiB), '512MiB', 1e9 -> bytes. Raises ValueError on nonsense."""
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ValueError(f"a memory size must be positive, got {text!r}")
        return int(text)
    s = str(text).strip().replace(" ", "")
    units = {"gib": GiB, "gb": GiB, "g": GiB, "mib": MiB, "mb": MiB, "m": MiB, "kib": KiB, "kb": KiB, "k": KiB, "b": 1}
    for u in sorted(units, key=len, reverse=True):
        if s.lower().endswith(u):
            num = s[: -len(u)]
            break
    else:
        u, num = "b", s
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"cannot read a memory size from {text!r} (try '8GiB' or '512MiB')") from None
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value * units[u])
