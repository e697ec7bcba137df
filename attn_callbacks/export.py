"""Saving one epoch's attention sums to disk, reading them back, and exporting an attention graph.

An *epoch export* holds, per attention module, only the raw sums of :class:`~attn_callbacks.metrics.AttentionStats`
(``S``, ``C``, ``Q``, ``skipped_rows``, ``U``, ``position_sums``): everything else is derived from them on load, so a
loaded epoch gives exactly (``torch.equal``) what :meth:`AttentionAccumulator.compute` gave. Two formats, chosen by
the file suffix:

- ``.pt``: ``torch.save`` of a plain dict (tensors, ints, strings, lists, dicts), loadable with
  ``torch.load(path, weights_only=True)``::

      {"format": "attn_callbacks.epoch", "version": 1, "epoch": int, "global_step": int,
       "streams": {module: [query_stream, key_stream]}, "labels": {stream: [str, ...] or None},
       "modules": {module: {"attention_sum": Tensor, "pair_count": Tensor, ...}}}

- ``.npz``: ``numpy.savez_compressed``, loadable with ``numpy.load(path, allow_pickle=False)``: the arrays
  ``"{i}.attention_sum"``, ``"{i}.pair_count"`` ... for the ``i``-th module, and ``"__meta__"``, a 0-d string array
  holding JSON with the same keys as the ``.pt`` dict except that ``"modules"`` is the list of module names (the
  ``i``-th name owns the arrays ``"{i}.*"``) and ``"dtypes"`` gives each array's torch dtype.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import torch
from torch import Tensor

from attn_callbacks.accumulate import SUM_FIELDS, AttentionStats
from attn_callbacks.kernels import POSITION_STATS
from attn_callbacks.summary import in_degree
from attn_callbacks.tables import pagerank

__all__ = ["FORMAT_VERSION", "EpochRecord", "export_graph", "load_epoch", "save_epoch"]

#: Version of the on-disk layout written by :func:`save_epoch`; :func:`load_epoch` reads this version only.
FORMAT_VERSION = 1

_FORMAT_NAME = "attn_callbacks.epoch"
_SUFFIXES = (".pt", ".npz")
_META_KEY = "__meta__"
_DTYPES = {str(dtype): dtype for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64)}


class EpochRecord(NamedTuple):
    """One saved validation epoch, as returned by :func:`load_epoch`.

    Attributes:
        epoch: the trainer's ``current_epoch`` when it was saved.
        global_step: the trainer's ``global_step`` when it was saved.
        modules: attention module name -> its statistics, with ``P = S / Q`` and ``M = S / C`` derived again.
        streams: module name -> ``(query_stream, key_stream)``; a module is self-attention when both are equal.
        labels: stream name -> whole token strings for ids ``0 .. V-1``, or None when the run had no labels.
    """

    epoch: int
    global_step: int
    modules: dict[str, AttentionStats]
    streams: dict[str, tuple[str, str]]
    labels: dict[str, list[str] | None]

    def export_graph(
        self, module: str, path: str | os.PathLike, *, head: int | None = None, min_weight: float = 0.0
    ) -> Path:
        """:func:`export_graph` for one module of this epoch, with its labels and stream wiring.

        Args:
            module: the attention module's name, a key of :attr:`modules`.
            path: the ``.graphml`` file to write.
            head: as in :func:`export_graph`.
            min_weight: as in :func:`export_graph`.

        Returns:
            The path written, as a :class:`~pathlib.Path`.
        """
        if module not in self.modules:
            raise ValueError(f"Expected argument `module` to be one of {sorted(self.modules)}, but got {module!r}")
        query_stream, key_stream = self.streams[module]
        return export_graph(
            path,
            self.modules[module],
            query_labels=self.labels.get(query_stream),
            key_labels=self.labels.get(key_stream),
            self_attention=query_stream == key_stream,
            head=head,
            min_weight=min_weight,
        )


# --------------------------------------------------------------------------------------------------------- saving
def save_epoch(
    path: str | os.PathLike,
    stats: Mapping[str, AttentionStats],
    *,
    streams: Mapping[str, tuple[str, str]],
    labels: Mapping[str, Sequence[str] | None],
    epoch: int,
    global_step: int,
) -> Path:
    """Save the raw attention sums of one epoch, for every module, to a ``.pt`` or ``.npz`` file.

    Only ``S`` (``attention_sum``), ``C`` (``pair_count``), ``Q`` (``query_count``), ``skipped_rows``, ``U``
    (``uniform_sum``) and ``position_sums`` are stored, moved to the CPU; ``P = S / Q`` and ``M = S / C`` are derived
    again by :func:`load_epoch`. The layout of both formats is described in this module's docstring. The file is
    written next to its final name and renamed into place, so an interrupted run never leaves a half-written export;
    parent directories are created.

    Args:
        path: the file to write; its suffix picks the format: ``.pt`` or ``.npz``.
        stats: attention module name -> its statistics (what :meth:`AttentionAccumulator.compute` returned).
        streams: module name -> ``(query_stream, key_stream)``, for every module in ``stats``.
        labels: stream name -> whole token strings for ids ``0 .. V-1`` of that stream, or None. A stream missing
            here is saved as None.
        epoch: the epoch number to record.
        global_step: the global step to record.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: for an unknown suffix, a module without streams, or labels whose length is not the vocabulary
            size of the stream.

    Example:
        >>> import tempfile, torch
        >>> from attn_callbacks import AttentionAccumulator
        >>> acc = AttentionAccumulator(num_heads=1, query_vocab_size=2, key_vocab_size=2)
        >>> ids, valid = torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bool)
        >>> acc.update(torch.tensor([[[[0.5, 0.5], [0.0, 1.0]]]]), ids, ids, valid, valid)
        >>> file = save_epoch(f"{tempfile.mkdtemp()}/e.pt", {"attn": acc.compute()}, streams={"attn": ("x", "x")},
        ...                   labels={"x": ["a", "b"]}, epoch=0, global_step=10)
        >>> load_epoch(file).modules["attn"].attention_mass[0].tolist()
        [[0.5, 0.5], [0.0, 1.0]]
    """
    path = Path(path)
    suffix = _format_of(path)
    epoch = _non_negative_int("epoch", epoch)
    global_step = _non_negative_int("global_step", global_step)

    modules: dict[str, dict[str, Tensor]] = {}
    vocab: dict[str, int] = {}  # stream -> size, to check labels against
    saved_streams: dict[str, list[str]] = {}
    for name, module_stats in stats.items():
        if name not in streams:
            raise ValueError(f"Expected argument `streams` to have an entry for module {name!r}, but got {streams!r}")
        query_stream, key_stream = (str(stream) for stream in streams[name])
        saved_streams[name] = [query_stream, key_stream]
        # A copy, not a view: torch.save writes a view's whole storage, and the caller's tensors may live on a GPU.
        modules[name] = {field: getattr(module_stats, field).detach().to("cpu", copy=True) for field in SUM_FIELDS}
        _check_sums(name, modules[name], where="argument `stats`")
        _, vocab[query_stream], vocab[key_stream] = modules[name]["attention_sum"].shape
    saved_labels: dict[str, list[str] | None] = {}
    for stream, size in vocab.items():
        tokens = labels.get(stream)
        if tokens is not None:
            tokens = [str(token) for token in tokens]
            if len(tokens) != size:
                raise ValueError(
                    f"Expected argument `labels` to give {size} tokens for stream {stream!r} (its vocabulary size), "
                    f"but got {len(tokens)}"
                )
        saved_labels[stream] = tokens

    header = {
        "format": _FORMAT_NAME,
        "version": FORMAT_VERSION,
        "epoch": epoch,
        "global_step": global_step,
        "streams": saved_streams,
        "labels": saved_labels,
    }
    if suffix == ".pt":
        _write_atomically(path, lambda file: torch.save({**header, "modules": modules}, file))
    else:
        arrays = {
            f"{i}.{field}": _to_numpy(tensor)
            for i, sums in enumerate(modules.values())
            for field, tensor in sums.items()
        }
        meta = {
            **header,
            "modules": list(modules),
            "dtypes": {
                f"{i}.{field}": str(t.dtype) for i, sums in enumerate(modules.values()) for field, t in sums.items()
            },
        }
        arrays[_META_KEY] = np.array(json.dumps(meta))  # a unicode array, not an object: no pickle needed
        _write_atomically(path, lambda file: np.savez_compressed(file, **arrays))
    return path


def _to_numpy(tensor: Tensor) -> np.ndarray:
    # numpy has no bfloat16; float32 holds every bfloat16 exactly, and the recorded dtype casts it back on load.
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# -------------------------------------------------------------------------------------------------------- loading
def load_epoch(path: str | os.PathLike) -> EpochRecord:
    """Read an epoch written by :func:`save_epoch` (either format) and derive ``P`` and ``M`` again.

    Each module's :class:`~attn_callbacks.metrics.AttentionStats` is rebuilt from the stored sums through
    :func:`attn_callbacks.metrics.stats_from_sums` (``P = S / Q[:, None]``, ``M = S / C`` per head, see
    :func:`attn_callbacks.functional.attention_mass` and :func:`attn_callbacks.functional.mean_weight`), so every field
    equals exactly what :meth:`AttentionAccumulator.compute` returned when the epoch was saved. Tensors are on the CPU.

    Args:
        path: a ``.pt`` or ``.npz`` file.

    Returns:
        The :class:`EpochRecord`.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: for an unknown suffix, a file that is not an epoch export, or an unknown format version.
    """
    path = Path(path)
    suffix = _format_of(path)
    if not path.is_file():
        raise FileNotFoundError(f"No attention epoch export at {str(path)!r}")
    header, sums = _read_pt(path) if suffix == ".pt" else _read_npz(path)
    try:
        streams = {str(name): (str(pair[0]), str(pair[1])) for name, pair in dict(header["streams"]).items()}
        labels = {
            str(stream): None if tokens is None else [str(token) for token in tokens]
            for stream, tokens in dict(header["labels"]).items()
        }
        epoch, global_step = int(header["epoch"]), int(header["global_step"])
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(f"{str(path)!r} is not a valid attention epoch export: bad metadata ({error!r})") from None
    modules = {}
    for name, module_sums in sums.items():
        if name not in streams:
            raise ValueError(f"{str(path)!r} is not a valid attention epoch export: no streams for module {name!r}")
        _check_sums(name, module_sums, where=repr(str(path)))
        modules[name] = AttentionStats(*(module_sums[field] for field in SUM_FIELDS))
    return EpochRecord(epoch=epoch, global_step=global_step, modules=modules, streams=streams, labels=labels)


def _not_an_export(path: Path, why: str) -> ValueError:
    return ValueError(f"{str(path)!r} is not an attention epoch export written by attn_callbacks.save_epoch: {why}")


def _check_header(path: Path, header: Any) -> dict:
    if not isinstance(header, Mapping) or header.get("format") != _FORMAT_NAME:
        raise _not_an_export(path, f"no {_FORMAT_NAME!r} format marker")
    version = header.get("version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{str(path)!r} has attention export format version {version!r}, but this attn_callbacks reads version "
            f"{FORMAT_VERSION} only (a newer version wrote it? upgrade attn_callbacks)"
        )
    return dict(header)


def _read_pt(path: Path) -> tuple[dict, dict[str, dict[str, Tensor]]]:
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types (UnpicklingError, RuntimeError, EOFError ...)
        raise _not_an_export(path, f"torch.load(weights_only=True) failed ({type(error).__name__})") from error
    header = _check_header(path, content)
    modules = header.pop("modules", None)
    if not isinstance(modules, Mapping) or not all(isinstance(sums, Mapping) for sums in modules.values()):
        raise _not_an_export(path, "no per-module sums")
    return header, {str(name): dict(sums) for name, sums in modules.items()}


def _read_npz(path: Path) -> tuple[dict, dict[str, dict[str, Tensor]]]:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
        raise _not_an_export(path, f"numpy.load failed ({type(error).__name__}: {error})") from error
    if _META_KEY not in arrays:
        raise _not_an_export(path, f"no {_META_KEY!r} array")
    try:
        meta = json.loads(str(arrays.pop(_META_KEY)))
    except json.JSONDecodeError as error:
        raise _not_an_export(path, f"{_META_KEY!r} is not JSON") from error
    header = _check_header(path, meta)
    names, dtypes = header.pop("modules", None), header.pop("dtypes", None)
    if not isinstance(names, list) or not isinstance(dtypes, Mapping):
        raise _not_an_export(path, "no module list")
    sums: dict[str, dict[str, Tensor]] = {}
    for i, name in enumerate(names):
        sums[str(name)] = {}
        for field in SUM_FIELDS:
            key = f"{i}.{field}"
            if key in arrays:
                dtype = _DTYPES.get(str(dtypes.get(key)))
                tensor = torch.from_numpy(arrays[key])
                sums[str(name)][field] = tensor if dtype is None else tensor.to(dtype)
    return header, sums


def _check_sums(name: str, sums: Mapping[str, Any], where: str) -> None:
    """The shapes :class:`AttentionStats` promises; a corrupt file fails here rather than deep inside a metric."""
    missing = [field for field in SUM_FIELDS if not isinstance(sums.get(field), Tensor)]
    if missing:
        raise ValueError(f"Module {name!r} in {where} lacks the sums {missing}")
    attention_sum = sums["attention_sum"]
    if attention_sum.dim() != 3:
        raise ValueError(f"Module {name!r} in {where}: expected attention_sum (H, Vq, Vk), got {_shape(attention_sum)}")
    heads, vocab_q, vocab_k = attention_sum.shape
    expected = {
        "pair_count": (vocab_q, vocab_k),
        "query_count": (vocab_q,),
        "skipped_rows": (),
        "uniform_sum": (vocab_q, vocab_k),
        # per_head=False keeps one (head-mean) attention channel but position statistics for every head
        "position_sums": (len(POSITION_STATS), heads if heads > 1 else sums["position_sums"].shape[-1]),
    }
    for field, shape in expected.items():
        if tuple(sums[field].shape) != shape:
            raise ValueError(
                f"Module {name!r} in {where}: expected {field} of shape {shape}, got {_shape(sums[field])}"
            )


def _shape(tensor: Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"Expected argument `path` to end in '.pt' or '.npz', but got {str(path)!r}")
    return suffix


def _non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"Expected argument `{name}` to be a non-negative integer, but got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------------------- graph
# Characters XML 1.0 cannot hold at all (a GraphML reader would reject the whole file).
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_safe(text: str) -> str:
    return _XML_INVALID.sub(lambda match: match.group().encode("unicode_escape", "backslashreplace").decode(), text)


def export_graph(
    path: str | os.PathLike,
    stats: AttentionStats,
    *,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    self_attention: bool | None = None,
    head: int | None = None,
    min_weight: float = 0.0,
) -> Path:
    """Write the attention graph of one module as GraphML (for Gephi, Cytoscape, networkx ...).

    A directed edge ``a → b`` (query token ``a`` attends to key token ``b``) has attribute ``weight``, the attention
    mass averaged over heads, ``P̄[a, b] = mean_h S[h, a, b] / Q[a]`` (or ``P[head, a, b]`` for one head); only edges
    with ``weight > min_weight`` are written. Nodes are the tokens seen: ``Q[a] > 0`` or some head gave the token
    attention as a key. Node attributes:

    - ``label``: the token string (its id when there are no labels); ``token_id``: its id;
    - ``query_count``: ``Q[a]``, how often the token was a query;
    - ``in_degree``: its share of all attention received, ``Σ_a S̄[a, b] / Σ_a Q[a]``
      (:func:`attn_callbacks.functional.in_degree`, with ``S̄`` the sum of the graph's head or the head average);
    - self-attention only: ``pagerank`` of the walk that follows attention
      (:func:`attn_callbacks.functional.pagerank` of the whole ``P̄``).

    Self-attention (one vocabulary) gives one node per token, with the token id as node id. Cross-attention gives a
    bipartite graph: query nodes ``"q:<id>"`` and key nodes ``"k:<id>"``, with attribute ``role`` (``"query"`` or
    ``"key"``); key nodes have ``query_count`` 0 and query nodes ``in_degree`` 0, as edges only go query → key.

    Args:
        path: the file to write (parent directories are created).
        stats: the module's statistics.
        query_labels: token strings of the query vocabulary, or None for ids.
        key_labels: token strings of the key vocabulary, or None for ids. Ignored for self-attention.
        self_attention: whether queries and keys are the same stream. None: when ``Vq == Vk``. Pass False for
            cross-attention between two vocabularies of the same size.
        head: a head index for that head's graph; None for the head average.
        min_weight: edges with ``weight <= min_weight`` are left out.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ImportError: when networkx is not installed (``pip install 'attn_callbacks[graph]'``).
        ValueError: for a bad ``head``, ``min_weight`` or ``self_attention``.
    """
    try:
        import networkx as nx
    except ImportError as error:
        raise ImportError(
            "export_graph needs networkx: pip install 'attn_callbacks[graph]' (or pip install networkx)"
        ) from error
    num_heads, vocab_q, vocab_k = stats.attention_sum.shape
    if head is not None and (isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < num_heads):
        raise ValueError(f"Expected argument `head` to be None or an integer in [0, {num_heads}), but got {head!r}")
    if isinstance(min_weight, bool) or not isinstance(min_weight, (int, float)) or not min_weight >= 0:
        raise ValueError(f"Expected argument `min_weight` to be a non-negative number, but got {min_weight!r}")
    if self_attention is None:
        self_attention = vocab_q == vocab_k
    elif self_attention and vocab_q != vocab_k:
        raise ValueError(
            f"Expected argument `self_attention` to be False for a {vocab_q} x {vocab_k} (not square) matrix, "
            f"but got {self_attention!r}"
        )

    attention_sum = stats.attention_sum.detach().cpu()
    query_count = stats.query_count.detach().cpu()
    mass_heads = stats.attention_mass.detach().cpu()
    if head is None:
        mass, graph_sum = mass_heads.mean(dim=0), attention_sum.mean(dim=0)  # P̄ = mean_h P[h], S̄ = mean_h S[h]
    else:
        mass, graph_sum = mass_heads[head], attention_sum[head]
    degree = in_degree(graph_sum, query_count)  # (Vk,)
    # One node set for every head choice, so graphs of different heads line up.
    queried = (query_count > 0).tolist()
    received = (attention_sum.sum(dim=(0, 1)) > 0).tolist()
    q_names = _labels("query_labels", query_labels, vocab_q)
    k_names = q_names if self_attention else _labels("key_labels", key_labels, vocab_k)

    graph = nx.DiGraph(head="mean" if head is None else str(head), min_weight=float(min_weight))
    if self_attention:
        rank = pagerank(mass)
        for token in range(vocab_q):
            if queried[token] or received[token]:
                graph.add_node(
                    token,
                    label=q_names[token],
                    token_id=token,
                    query_count=int(query_count[token]),
                    in_degree=float(degree[token]),
                    pagerank=float(rank[token]),
                )

        def query_node(token: int) -> Any:
            return token

        key_node = query_node
    else:
        for token in range(vocab_q):
            if queried[token]:
                attributes = {"label": q_names[token], "token_id": token, "role": "query"}
                graph.add_node(f"q:{token}", **attributes, query_count=int(query_count[token]), in_degree=0.0)
        for token in range(vocab_k):
            if received[token]:
                attributes = {"label": k_names[token], "token_id": token, "role": "key"}
                graph.add_node(f"k:{token}", **attributes, query_count=0, in_degree=float(degree[token]))

        def query_node(token: int) -> Any:
            return f"q:{token}"

        def key_node(token: int) -> Any:
            return f"k:{token}"

    sources, targets = torch.nonzero(mass > min_weight, as_tuple=True)
    weights = mass[sources, targets].tolist()
    graph.add_weighted_edges_from(
        (query_node(a), key_node(b), w) for a, b, w in zip(sources.tolist(), targets.tolist(), weights, strict=True)
    )
    path = Path(path)
    _write_atomically(path, lambda file: nx.write_graphml(graph, file))
    return path


def _labels(name: str, tokens: Sequence[str] | None, size: int) -> list[str]:
    if tokens is None:
        return [str(token) for token in range(size)]
    if len(tokens) != size:
        raise ValueError(
            f"Expected argument `{name}` to hold {size} tokens (the vocabulary size), but got {len(tokens)}"
        )
    return [_xml_safe(str(token)) for token in tokens]
