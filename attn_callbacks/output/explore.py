"""One module's epoch cut down to what the explorer tab shows (:mod:`attn_callbacks.explorer.data` writes it): the
most frequent tracked tokens, as many as ``explorer_size`` allows."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attn_callbacks.capture.streams import Streams
from attn_callbacks.explorer.data import planes_bytes
from attn_callbacks.metrics.tables import top_tokens
from attn_callbacks.sums.accumulator import AttentionStats

__all__ = ["explorer_tokens", "explorer_view"]

_JSON_BYTES_PER_TOKEN = 48  # an id, a label and a count in the JSON file, on average (labels of a few characters)


def explorer_tokens(heads: int, size: int, square: bool) -> int:
    """The most rows (and columns) whose planes and JSON fit ``size`` bytes: the largest ``n`` with
    ``(heads + 3) * n² * 4 + 2 * 48 * n <= size`` (at least 1)."""
    planes = (heads + 3) * 4
    # the positive root of planes * n² + json * n - size = 0
    json_bytes = _JSON_BYTES_PER_TOKEN * (1 if square else 2) * 2
    n = int((-json_bytes + math.sqrt(json_bytes**2 + 4 * planes * size)) / (2 * planes))
    while n > 1 and planes_bytes(heads, n, n) + json_bytes * n > size:  # float rounding at the root
        n -= 1
    return max(n, 1)


def explorer_view(
    *,
    view: str,
    module: str,
    streams: tuple[str, str],
    epoch: int,
    step: int,
    stats: AttentionStats,
    mass: Tensor,
    per_head: bool,
    size: int,
    tokens: Streams,
) -> dict[str, Any] | None:
    """What :func:`attn_callbacks.explorer.data.write_epoch` writes of one view's epoch (its keyword arguments but
    ``run_dir``; None when the view saw no token): ``P`` of the head mean (``mass``) and of each head (with
    ``per_head``), ``C`` and ``U`` over the most frequent tracked query tokens (rows) and, for cross-attention, the
    key tokens most often visible (columns), most frequent first. A copy: the sums may change once the epoch end is
    over.

    Args:
        view: as in :func:`attn_callbacks.explorer.data.write_epoch`.
        module: the module's name.
        streams: its ``(query_stream, key_stream)``.
        epoch: the trainer's ``current_epoch``.
        step: the step its images and tables are logged at (``trainer.global_step``).
        stats: the module's epoch statistics (``attention_mass`` computed).
        mass: ``mean_h P``, ``(Vq, Vk)``.
        per_head: whether the heads' planes are written.
        size: ``explorer_size``, in bytes.
        tokens: the monitor's token streams: which accumulated indices are tokens (``<other>`` left out), their
            vocabulary ids (tracked streams) and their whole labels.
    """
    query_stream, key_stream = streams
    square = query_stream == key_stream
    mass_heads = stats.attention_mass
    heads = mass_heads.shape[0] if per_head else 0
    n = explorer_tokens(heads, size, square)
    rows = top_tokens(stats.query_count[tokens.tokens(query_stream)], n)
    cols = rows if square else top_tokens(stats.pair_count[:, tokens.tokens(key_stream)].sum(dim=0), n)
    if not len(rows) or not len(cols):
        return None
    device_rows, device_cols = rows.to(mass.device), cols.to(mass.device)
    grid = (device_rows[:, None], device_cols[None, :])
    parts = [mass[grid][None]]
    if heads:
        parts.append(mass_heads[:, device_rows[:, None], device_cols[None, :]])
    parts += [stats.pair_count[grid].to(mass.dtype)[None], stats.uniform_sum[grid].to(mass.dtype)[None]]
    planes = torch.cat(parts).to(device="cpu", dtype=torch.float32).numpy()  # (heads + 3, n_q, n_k)
    row_list, col_list = rows.tolist(), cols.tolist()
    return dict(
        view=view,
        module=module,
        streams=streams,
        epoch=epoch,
        step=step,
        planes=np.ascontiguousarray(planes),
        query_ids=_vocab_ids(tokens, query_stream, row_list),
        key_ids=_vocab_ids(tokens, key_stream, col_list),
        query_labels=tokens.label(row_list, query_stream, max_length=None),
        key_labels=tokens.label(col_list, key_stream, max_length=None),
        query_count=stats.query_count[rows.to(stats.query_count.device)].long().tolist(),
    )


def _vocab_ids(tokens: Streams, stream: str, indices: list[int]) -> list[int]:
    """Accumulated indices -> vocabulary ids (a tracked stream's compact indices are not ids)."""
    ids = tokens.vocab_ids(stream)
    return indices if ids is None else [ids[i] for i in indices]
