"""Finding and reading attention: the hooks on ``nn.MultiheadAttention`` and Hugging Face modules and the fast-path
switch (:mod:`.hooks`), recomputed ``scaled_dot_product_attention`` calls (:mod:`.sdpa`, :mod:`.hf`), the token-id
streams of a batch and the tracked ids (:mod:`.streams`), and the probe batch (:mod:`.probe`). Imports :mod:`..base`
only; what it reads is handed to a consumer callback, never summed here."""
