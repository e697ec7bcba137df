"""The base layer every part may use: argument checks and types (:mod:`.config`), small tensor operations and the
two ratios of the sums (:mod:`.tensor_ops`), the lazy numba loader and the numba math the CPU twins share
(:mod:`.numba_loader`, :mod:`.numba_math`), token labels (:mod:`.labels`) and atomic file writes (:mod:`.files`,
standard library only: the explorer plugin uses it without torch). It imports torch, numpy and Lightning's warning
helpers only, never another part of the package."""
