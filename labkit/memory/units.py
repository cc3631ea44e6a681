"""Byte units: sizes are printed in binary units (GiB = 2**30), what devices and allocators report; read in
binary (GiB) or decimal (GB = 10**9) units, as written."""

from __future__ import annotations

KiB, MiB, GiB = 2**10, 2**20, 2**30


def fmt_bytes(n: float, digits: int = 2) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} B"


# unit -> bytes: binary units (KiB, MiB, GiB, TiB; K, M, G, T alone are read as binary too, as PyTorch and
# nvidia-smi print them) and decimal SI units (kB/KB, MB, GB, TB: 10**3, 10**6, 10**9, 10**12 bytes, as
# vendors sell memory and disks, IEC 80000-13)
UNITS = {"tib": 2**40, "gib": GiB, "mib": MiB, "kib": KiB, "t": 2**40, "g": GiB, "m": MiB, "k": KiB,
         "tb": 10**12, "gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}


def parse_bytes(text: str | float | int) -> int:
    """'8GiB' (8 x 2**30), '8 GB' (8 x 10**9), '512MiB', '1.5G' (binary), 1e9 -> bytes. Raises ValueError on
    nonsense."""
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ValueError(f"a memory size must be positive, got {text!r}")
        return int(text)
    s = str(text).strip().replace(" ", "")
    for u in sorted(UNITS, key=len, reverse=True):
        if s.lower().endswith(u):
            num = s[: -len(u)]
            break
    else:
        u, num = "b", s
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"cannot read a memory size from {text!r} (try '24GiB' = 24 x 2**30 bytes or '24GB' = "
                         "24 x 10**9 bytes)") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"a memory size must be positive and finite, got {text!r}")
    return int(value * UNITS[u])


def parse_size_option(text: str) -> int:
    """A memory size given on a command line (plan --memory, wall --budgets, estimate --budget): the unit is
    required, since a bare number could mean bytes, GB or GiB. '24GB' -> 24 x 10**9, '24GiB' -> 24 x 2**30;
    ValueError for a bare number ("give a unit: 24GB or 24GiB"), a negative or zero size, or nonsense."""
    s = str(text).strip().replace(" ", "")
    if s.startswith("-"):
        raise ValueError(f"a memory budget must be positive, got {text!r}")
    try:
        float(s)
    except ValueError:
        pass
    else:
        raise ValueError(f"give a unit: {s}GB or {s}GiB (a bare number {s!r} could be bytes, GB or GiB)"
                         if s.lstrip("+").replace(".", "", 1).isdigit() else
                         f"give a size with a unit, such as 24GB or 24GiB, not {text!r}")
    return parse_bytes(s)


# One rule for "does it fit" (plan, estimate --budget, wall): a predicted peak above the budget does not fit;
# one within HEADROOM of it is tight (the estimate counts logical bytes: the allocator's rounding and
# fragmentation and the CUDA context are not in them); any other fits.
HEADROOM = 0.10  # the default share of the budget a step should leave free
FITS, TIGHT, DOES_NOT_FIT = "fits", "tight", "does not fit"


def is_tight(peak: float, budget: float, headroom: float = HEADROOM) -> bool:
    """The peak is above (1 - headroom) x budget: less than `headroom` of the budget is left free."""
    return peak > (1 - headroom) * budget


def fit_verdict(peak: float, budget: float, headroom: float = HEADROOM) -> str:
    """FITS, TIGHT (fits, within `headroom` of the budget) or DOES_NOT_FIT (the peak is above the budget)."""
    if peak > budget:
        return DOES_NOT_FIT
    return TIGHT if is_tight(peak, budget, headroom) else FITS
