"""The base layer every part may use: argument checks and types (:mod:`.config`), small tensor operations and the
two ratios of the sums (:mod:`.tensor_ops`), the lazy numba loader and the numba math the CPU twins share
(:mod:`.numba_loader`, :mod:`.numba_math`) and token labels (:mod:`.labels`). It imports torch, numpy and
Lightning's warning helpers only, never another part of the package."""
