"""Exporting one module's attention as a GraphML graph of tokens (nodes) and attention mass (edges)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from attn_callbacks.base.files import write_atomically
from attn_callbacks.base.labels import OTHER_LABEL
from attn_callbacks.metrics.summary import in_degree
from attn_callbacks.metrics.tables import pagerank
from attn_callbacks.output.epoch_files import not_a_folder
from attn_callbacks.sums.accumulator import AttentionStats

__all__ = ["export_graph"]

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
    query_ids: Sequence[int] | None = None,
    key_ids: Sequence[int] | None = None,
    self_attention: bool | None = None,
    head: int | None = None,
    min_weight: float = 0.0,
) -> Path:
    """Write the attention graph of one module as GraphML (for Gephi, Cytoscape, networkx ...).

    A directed edge ``a → b`` (query token ``a`` attends to key token ``b``) has attribute ``weight``, the attention
    mass averaged over heads, ``P̄[a, b] = mean_h S[h, a, b] / Q[a]`` (or ``P[head, a, b]`` for one head); only edges
    with ``weight > min_weight`` are written. Nodes are the tokens seen: ``Q[a] > 0`` or some head gave the token
    attention as a key. Node attributes:

    - ``label``: the token string (its id when there are no labels); ``token_id``: its vocabulary id;
    - ``query_count``: ``Q[a]``, how often the token was a query;
    - ``in_degree``: its share of all attention received, ``Σ_a S̄[a, b] / Σ_a Q[a]``
      (:func:`attn_callbacks.functional.in_degree`, with ``S̄`` the sum of the graph's head or the head average);
    - self-attention only: ``pagerank`` of the walk that follows the graph's attention
      (:func:`attn_callbacks.functional.pagerank` of ``P̄``, or of ``P[head]``, over every index of the sums: ids
      never seen take part in the uniform restart, so the nodes' values can sum to less than 1).

    Self-attention (one vocabulary) gives one node per token, with the token's vocabulary id as node id.
    Cross-attention gives a bipartite graph: query nodes ``"q:<id>"`` and key nodes ``"k:<id>"``, with attribute
    ``role`` (``"query"`` or ``"key"``); key nodes have ``query_count`` 0 and query nodes ``in_degree`` 0, as edges
    only go query → key. A stream tracked to its most frequent ids (``query_ids`` / ``key_ids`` given) has a node
    ``"<other>"`` (``"q:<other>"``, ``"k:<other>"``) for the bucket of every untracked id, without ``token_id``.

    Args:
        path: the file to write (parent directories are created).
        stats: the module's statistics.
        query_labels: token strings of the query vocabulary, or None for ids.
        key_labels: token strings of the key vocabulary, or None for ids. Ignored for self-attention.
        query_ids: for a tracked query stream, the vocabulary id of each index of the sums but the last, ``<other>``
            (:attr:`EpochRecord.vocab_ids`); None when each index is its id.
        key_ids: the same for the key stream. Ignored for self-attention.
        self_attention: whether queries and keys are the same stream. None: when ``Vq == Vk``. Pass False for
            cross-attention between two vocabularies of the same size.
        head: a head index for that head's graph; None for the head average.
        min_weight: edges with ``weight <= min_weight`` are left out.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ImportError: when networkx is not installed (``pip install 'attn_callbacks[graph]'``).
        ValueError: for a bad ``head``, ``min_weight`` or ``self_attention``, or a ``path`` that is a folder or lies
            below a file.
    """
    try:
        import networkx as nx
    except ImportError as error:
        raise ImportError(
            "export_graph needs networkx: pip install 'attn_callbacks[graph]' (or pip install networkx)"
        ) from error
    path = Path(path)
    blocking = path if path.is_dir() else not_a_folder(path.parent)
    if blocking is not None:
        what = "a folder" if blocking == path else f"below {str(blocking)!r}, which is not a folder"
        raise ValueError(f"Expected argument `path` to be a file to write, but got {str(path)!r}, {what}")
    num_heads, vocab_q, vocab_k = stats.attention_sum.shape
    if head is not None and num_heads == 1 < stats.position_sums.shape[-1]:  # per_head=False: the head mean only
        raise ValueError(
            f"Expected argument `head` to be None for sums of the head mean only (monitored with per_head=False, "
            f"{stats.position_sums.shape[-1]} heads), but got {head!r}"
        )
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
    q_ids = _vocab_ids("query_ids", query_ids, vocab_q)
    k_ids = q_ids if self_attention else _vocab_ids("key_ids", key_ids, vocab_k)
    q_names = _labels("query_labels", query_labels, q_ids)
    k_names = q_names if self_attention else _labels("key_labels", key_labels, k_ids)
    q_nodes = [OTHER_LABEL if i is None else i for i in q_ids]
    k_nodes = [OTHER_LABEL if i is None else i for i in k_ids]

    graph = nx.DiGraph(head="mean" if head is None else str(head), min_weight=float(min_weight))
    if self_attention:
        rank = pagerank(mass)
        for token in range(vocab_q):
            if queried[token] or received[token]:
                graph.add_node(
                    q_nodes[token],
                    label=q_names[token],
                    **_token_id(q_ids[token]),
                    query_count=int(query_count[token]),
                    in_degree=float(degree[token]),
                    pagerank=float(rank[token]),
                )

        def query_node(token: int) -> Any:
            return q_nodes[token]

        key_node = query_node
    else:

        def query_node(token: int) -> Any:
            return f"q:{q_nodes[token]}"

        def key_node(token: int) -> Any:
            return f"k:{k_nodes[token]}"

        for token in range(vocab_q):
            if queried[token]:
                attributes = {"label": q_names[token], **_token_id(q_ids[token]), "role": "query"}
                graph.add_node(query_node(token), **attributes, query_count=int(query_count[token]), in_degree=0.0)
        for token in range(vocab_k):
            if received[token]:
                attributes = {"label": k_names[token], **_token_id(k_ids[token]), "role": "key"}
                graph.add_node(key_node(token), **attributes, query_count=0, in_degree=float(degree[token]))

    sources, targets = torch.nonzero(mass > min_weight, as_tuple=True)
    weights = mass[sources, targets].tolist()
    graph.add_weighted_edges_from(
        (query_node(a), key_node(b), w) for a, b, w in zip(sources.tolist(), targets.tolist(), weights, strict=True)
    )
    write_atomically(path, lambda file: nx.write_graphml(graph, file))
    return path


def _vocab_ids(name: str, ids: Sequence[int] | None, size: int) -> list[int | None]:
    """The vocabulary id of each index of the sums, None for a tracked stream's last index, ``<other>``."""
    if ids is None:
        return list(range(size))
    if len(ids) != size - 1:
        raise ValueError(
            f"Expected argument `{name}` to hold {size - 1} ids (the sums' {size} indices but the last, <other>), "
            f"but got {len(ids)}"
        )
    return [int(i) for i in ids] + [None]


def _token_id(vocab_id: int | None) -> dict[str, int]:
    return {} if vocab_id is None else {"token_id": vocab_id}


def _labels(name: str, tokens: Sequence[str] | None, ids: list[int | None]) -> list[str]:
    if tokens is None:
        return [OTHER_LABEL if i is None else str(i) for i in ids]
    if len(tokens) != len(ids):
        raise ValueError(
            f"Expected argument `{name}` to hold {len(ids)} tokens (the vocabulary size), but got {len(tokens)}"
        )
    return [_xml_safe(str(token)) for token in tokens]
