"""The guard's compiled loops (sidecar/guard/_ngrams.c): the one place that imports them and
decides whether they are used.

`pip install -e .` builds the module where a C compiler is there (pyproject.toml: optional).
`NGRAMS` is it where it was built from this checkout's _ngrams.c, else None, and lexical.py and
normalize.py both run their numpy code, the definition: a checkout that was not rebuilt keeps
an older build, which may lack a function or state another n-gram definition.

The n-gram definition's constants are here, not in lexical.py, because the check needs them
and normalize.py, below lexical.py, imports this module.
"""
from __future__ import annotations

from types import ModuleType

DIM_BITS = 18
ORDERS = (3, 4, 5)
MAX_CHARS = 8192
WINDOW = 200   # chosen on validation attacks appended to validation documents (eval: "appended")
PRIME = 0x100000001B3
MIX = 0x9E3779B97F4A7C15

# What lexical.py, normalize.py and pii.py read of it, besides the constants above.
NAMES = ("buckets", "score", "fold_by_table", "squeeze_by_table", "BEYOND_BMP", "runs")


def current(module: ModuleType) -> bool:
    """Whether `module` is what this checkout's _ngrams.c builds: every name the Python code
    reads, and the same n-gram definition."""
    if not all(hasattr(module, name) for name in NAMES):
        return False
    stated = tuple(getattr(module, name, None) for name in ("DIM_BITS", "ORDERS", "MAX_CHARS", "WINDOW", "PRIME", "MIX"))
    return stated == (DIM_BITS, ORDERS, MAX_CHARS, WINDOW, PRIME, MIX)


try:
    from sidecar.guard import _ngrams as NGRAMS
except ImportError:         # not built
    NGRAMS = None
if NGRAMS is not None and not current(NGRAMS):
    NGRAMS = None
