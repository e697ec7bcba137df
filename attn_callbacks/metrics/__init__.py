"""Pure functions from the sums to every logged number and table: layer and head statistics (:mod:`.summary`), the
text tables (:mod:`.tables`), drift and the memory of earlier epochs it compares against (:mod:`.drift`); a numba
twin (``*_numba``) sits beside a torch definition only where it is measured faster, and is tested against it.
Imports :mod:`..base` and :mod:`..sums` (the result type and the layout of the position sums)."""
