"""Closed-form cost formulas of the papers, and alpha-beta models of collectives.

Pure functions of numbers (``math`` only): the planner's cost model
(:mod:`~gnncompile.cost_models.model`) calls the time models, and the closed forms are checks of
what the planner predicts for a plan (see DESIGN.md, "Cost models"). Papers (``papers/`` in the
shared folder):

- NeutronTask: task parallelism, §5.1 (communication complexity, intermediate data) and §5.2
  (task scheduling model, Eq. 5-8);
- GNNPipe: layer-level model parallelism and its hybrid with graph parallelism, §3.5;
- NeutronTP: GNN tensor parallelism, §3.2 (workload analysis) and §4.1 (decoupled training);
- MixGCN: mixture of parallelism (MoP), §3.1.2 (Algorithm 2, Proposition 3.4);
- GSPLIT: split parallelism, §2–4 (expected sizes of a sampled mini-batch and its splits).

Conventions
-----------
- Times are seconds; ``flops`` is FLOP/s; ``bandwidth`` is bytes/s (one direction, per rank);
  ``latency`` is seconds per message.
- The papers count *elements* (floats). Every function here that returns a data volume returns
  **bytes**: elements times ``elsize`` (bytes per element, default 4 = float32).
- Communication volumes are totals over all GPUs (bytes put on the wire by all senders together)
  for **one training step** (forward and backward) unless a function says otherwise; the papers'
  forward-only expressions are the ``backward=False`` (or ``grad_layers=0``) case.
- Invalid arguments (negative or non-finite sizes, a GPU count below 1, ``gamma`` outside [0, 1],
  ...) raise :class:`~gnncompile.errors.PlanningError`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

from ..errors import PlanningError

__all__ = [
    # NeutronTask §5.2
    "t_task_time", "p_task_time", "task_gpu_split_exact", "task_gpu_split",
    # NeutronTask §5.1
    "intermediate_data_dp",
    # communication closed forms
    "comm_data", "comm_task", "comm_task_decoupled", "comm_layer_hybrid", "comm_tensor", "comm_mop",
    # collectives
    "p2p_time", "ring_allreduce_time", "ring_allgather_time", "ring_reduce_scatter_time", "all_to_all_time",
    "halo_exchange_time", "ring_allreduce_bytes", "ring_allgather_bytes", "ring_reduce_scatter_bytes",
    # GSPLIT
    "sampled_sizes", "split_remote_rows",
]

Number = Union[int, float]


# --------------------------------------------------------------------------- argument checks
def _nonneg(name: str, value: Number) -> Number:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise PlanningError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def _pos(name: str, value: Number) -> Number:
    _nonneg(name, value)
    if value == 0:
        raise PlanningError(f"{name} must be > 0, got {value!r}")
    return value


def _count(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanningError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _dims(name: str, dims: Sequence[int], minimum: int = 1) -> list[int]:
    try:
        out = list(dims)
    except TypeError:
        raise PlanningError(f"{name} must be a sequence of dimensions, got {dims!r}") from None
    if len(out) < minimum:
        raise PlanningError(f"{name} needs at least {minimum} entries, got {len(out)}")
    for i, d in enumerate(out):
        _nonneg(f"{name}[{i}]", d)
    return out


def _gamma(gamma: float) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
        raise PlanningError(f"gamma must be in [0, 1], got {gamma!r}")
    return gamma


def _elsize(elsize: int) -> int:
    return _count("elsize", elsize, 1)


def _layer_widths(dim: Union[int, Sequence[int]], num_layers: int) -> list[Number]:
    """``dim`` as one width per layer: a scalar repeated ``num_layers`` times, or a sequence of that length."""
    if isinstance(dim, (int, float)) and not isinstance(dim, bool):
        return [_nonneg("dim", dim)] * num_layers
    widths = _dims("dim", dim, 0)
    if len(widths) != num_layers:
        raise PlanningError(f"dim has {len(widths)} per-layer widths but num_layers = {num_layers}")
    return widths


# --------------------------------------------------------------------------- NeutronTask §5.2
def t_task_time(num_nodes: int, num_edges: int, dims: Sequence[int], edge_dim: Optional[int],
                flops: float) -> float:
    r"""Computation time of the T tasks (NeutronTask §5.2, Eq. 5), seconds.

    .. math:: T_t = \frac{\sum_{l=1}^{L} 2|V| d_v^{(l)} d_v^{(l+1)} + 2|E| d_e d_e}{FLOPS}

    - ``num_nodes`` = :math:`|V|`, ``num_edges`` = :math:`|E|`;
    - ``dims`` = :math:`(d_v^{(1)}, \dots, d_v^{(L+1)})`, the vertex embedding widths before and after
      each of the :math:`L` vertex-based T tasks (a dense ``d^(l) x d^(l+1)`` transform per vertex,
      2 FLOPs per multiply-add), so ``L = len(dims) - 1`` (e.g. a 2-layer GCN ``16 -> 8 -> 4`` has
      ``dims = (16, 8, 4)``);
    - ``edge_dim`` = :math:`d_e`: the paper's "edge-based T task in complex models" (GAT-like
      attention: one ``d_e x d_e`` transform per edge). The paper sets :math:`d_e = d_v^{(L)}`, the
      width of the last T task's input, i.e. ``dims[-2]``. Pass ``None`` for models without an edge
      T task (GCN, GraphSAGE): the edge term is then left out;
    - ``flops`` = FLOPS, the GPU's FLOP/s.
    """
    _nonneg("num_nodes", num_nodes)
    _nonneg("num_edges", num_edges)
    d = _dims("dims", dims, 2)
    _pos("flops", flops)
    work = sum(2.0 * num_nodes * a * b for a, b in zip(d, d[1:]))
    if edge_dim is not None:
        _nonneg("edge_dim", edge_dim)
        work += 2.0 * num_edges * edge_dim * edge_dim
    return work / flops


def p_task_time(num_nodes: int, avg_degree: float, dims: Sequence[int], flops: float, bandwidth: float,
                gamma: float, elsize: int = 4) -> float:
    r"""Execution time of the P tasks (NeutronTask §5.2, Eq. 6), seconds.

    .. math:: T_p = \sum_{l=1}^{L} \Big( \gamma \frac{2|V| \bar d\, d_v^{(l)}}{FLOPS}
              + (1 - \gamma) \frac{(|V| \bar d (1 + 2 d_v^{(l)}) + |V|) \cdot elsize}{Bandwidth} \Big)

    - ``num_nodes`` = :math:`|V|`; ``avg_degree`` = :math:`\bar d` (so :math:`|V|\bar d = |E|`);
    - ``dims`` = :math:`(d_v^{(1)}, \dots, d_v^{(L)})`: the width each of the :math:`L` P tasks
      propagates, one entry per P task (``L = len(dims)``). With the paper's list of Eq. 5
      (:math:`d_v^{(1..L+1)}`) this is ``dims[:-1]``; the cost model passes the width actually
      propagated by an op (``[width]`` for one P op);
    - ``flops`` = FLOPS (FLOP/s); ``gamma`` = :math:`\gamma \in [0, 1]`, the overlap of computation
      and memory traffic (empirical);
    - ``bandwidth`` = memory Bandwidth in **bytes/s**. The paper's memory term counts elements (per
      edge one index and the ``2d`` reads and writes of a row, plus one offset per vertex); it is
      multiplied by ``elsize`` (bytes per element, default 4) to match a bandwidth in bytes/s.
    """
    _nonneg("num_nodes", num_nodes)
    _nonneg("avg_degree", avg_degree)
    d = _dims("dims", dims, 0)
    _pos("flops", flops)
    _pos("bandwidth", bandwidth)
    g = _gamma(gamma)
    es = _elsize(elsize)
    t = 0.0
    for w in d:
        compute = 2.0 * num_nodes * avg_degree * w / flops
        memory = (num_nodes * avg_degree * (1 + 2 * w) + num_nodes) * es / bandwidth
        t += g * compute + (1 - g) * memory
    return t


def task_gpu_split_exact(num_gpus: int, t_t: float, t_p: float) -> float:
    r"""Real-valued number of GPUs for P tasks (NeutronTask §5.2, Eq. 7).

    .. math:: N_p = N_g \frac{T_p}{T_p + T_t}

    ``num_gpus`` = :math:`N_g`; ``t_t``, ``t_p`` = :math:`T_t`, :math:`T_p` (Eq. 5 and 6, any one
    time unit). :math:`N_t = N_g - N_p` (Eq. 8). With :math:`T_t = T_p = 0` the split is even
    (``N_g / 2``).
    """
    _count("num_gpus", num_gpus, 1)
    _nonneg("t_t", t_t)
    _nonneg("t_p", t_p)
    if t_t + t_p == 0:
        return num_gpus / 2
    return num_gpus * t_p / (t_p + t_t)


def task_gpu_split(num_gpus: int, t_t: float, t_p: float) -> tuple[int, int]:
    r"""Integer GPU counts ``(N_t, N_p)`` for T and P tasks (NeutronTask §5.2, Eq. 7-8).

    :math:`N_p` is Eq. 7 (:func:`task_gpu_split_exact`) rounded to the nearest integer (halves round
    up, towards P), then clamped to ``[1, N_g - 1]`` so that, with ``num_gpus >= 2``, each task kind
    gets at least one GPU however extreme the ratio; :math:`N_t = N_g - N_p` (Eq. 8), so
    ``N_t + N_p == num_gpus``. With ``num_gpus == 1`` the single GPU runs both kinds and the result
    is ``(1, 1)`` (the only case where the counts do not add up to ``num_gpus``).
    """
    exact = task_gpu_split_exact(num_gpus, t_t, t_p)
    if num_gpus == 1:
        return 1, 1
    n_p = min(max(int(math.floor(exact + 0.5)), 1), num_gpus - 1)
    return num_gpus - n_p, n_p


# --------------------------------------------------------------------------- NeutronTask §5.1
def intermediate_data_dp(num_nodes: int, num_layers: int, dim: Number, elsize: int = 4) -> Number:
    r"""Intermediate data of data-parallel training, **bytes** (NeutronTask §5.1, :math:`ID_{dp}`).

    .. math:: ID_{dp} = 2 |V| |L| |d| \cdot elsize

    ``num_nodes`` = :math:`|V|`, ``num_layers`` = :math:`L`, ``dim`` = :math:`|d|` the average hidden
    width; the factor 2 is the paper's (two ``|d|``-wide tensors cached per layer and vertex for the
    backward, cf. Fig. 8(a)). The paper counts elements; times ``elsize`` bytes each.
    """
    _nonneg("num_nodes", num_nodes)
    _count("num_layers", num_layers)
    _nonneg("dim", dim)
    return 2 * num_nodes * num_layers * dim * _elsize(elsize)


# --------------------------------------------------------------------------- communication closed forms
def comm_data(num_nodes: int, alpha: float, num_layers: int, dim: Union[Number, Sequence[Number]], *,
              grad_layers: Optional[int] = None, elsize: int = 4) -> float:
    r"""Halo-exchange volume of data (graph) parallelism, **bytes** per training step.

    NeutronTask §5.1: :math:`O((\alpha - 1)|V||L||d|)` elements forward, where
    ``alpha`` = :math:`\alpha \ge 1` is the replication factor (copies per vertex, masters included:
    :math:`(\alpha - 1)|V|` halo rows over all GPUs, each received once per layer), ``num_nodes`` =
    :math:`|V|`, ``num_layers`` = :math:`L`, ``dim`` = :math:`|d|`. (GNNPipe §2.3 writes the same,
    :math:`\mathcal{H}\sum_i|\mathcal{B}_i|` per layer, and notes the backward pass costs as much.)

    ``dim`` is a scalar width or one halo width per layer (length ``num_layers``), the width of the
    value propagated at that layer (it differs per layer in a real model). Backward, the gradients of
    the halo rows travel back to their owners for the last ``grad_layers`` layers; by default
    ``L - 1``: every layer but the first, whose propagated input (raw features) needs no gradient
    (GIN). ``grad_layers=L`` is a model whose first propagated value needs a gradient: the
    project's GCN and GraphSAGE transform before they propagate (``Â (X W)``), so every halo
    exchange has a backward. ``grad_layers=0`` gives the paper's forward-only volume.

    This is exactly what the ``data`` lowering predicts: its per-rank ``bytes_sent`` summed over the
    ranks, less the gradient all-reduce (:func:`ring_allreduce_bytes` per rank), equals this with
    ``dim`` = the plan's halo widths (``HaloExchange.width`` of the forward exchanges).

    .. math:: (\alpha - 1)|V| \Big(\sum_{l=1}^{L} d_l + \sum_{l=L-g+1}^{L} d_l\Big) \cdot elsize
    """
    _nonneg("num_nodes", num_nodes)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 1:
        raise PlanningError(f"alpha (replication factor) must be a finite number >= 1, got {alpha!r}")
    _count("num_layers", num_layers)
    widths = _layer_widths(dim, num_layers)
    g = max(num_layers - 1, 0) if grad_layers is None else _count("grad_layers", grad_layers)
    if g > num_layers:
        raise PlanningError(f"grad_layers = {g} exceeds num_layers = {num_layers}")
    rows = (alpha - 1) * num_nodes
    return rows * (sum(widths) + sum(widths[num_layers - g:])) * _elsize(elsize)


def comm_task(num_nodes: int, num_layers: int, dim: Number, *, backward: bool = True, elsize: int = 4) -> Number:
    r"""T/P transfer volume of (alternating) task parallelism, **bytes** (NeutronTask §5.1).

    :math:`O((2L - 1)|V||d|)` elements forward: every vertex embedding crosses between the T and P
    GPUs twice per layer (T -> P, P -> T), less the last return. ``num_nodes`` = :math:`|V|`,
    ``num_layers`` = :math:`L`, ``dim`` = :math:`|d|` (average width). With ``backward`` (default)
    the gradients make the same transfers back: twice the paper's volume.
    """
    _nonneg("num_nodes", num_nodes)
    _count("num_layers", num_layers, 1)
    _nonneg("dim", dim)
    return (2 if backward else 1) * (2 * num_layers - 1) * num_nodes * dim * _elsize(elsize)


def comm_task_decoupled(num_nodes: int, num_gpus: int, dim: Number, *, backward: bool = True,
                        elsize: int = 4) -> Number:
    r"""Transfer volume of task-decoupled task parallelism, **bytes** (NeutronTask §5.1).

    :math:`O((M - 1)|V||d|)` elements forward: all T tasks, then all P tasks, run as a pipeline over
    ``num_gpus`` = :math:`M` GPUs and each of the :math:`M - 1` boundaries passes the embeddings of all
    ``num_nodes`` = :math:`|V|` vertices once, at width ``dim`` = :math:`|d|`, independent of the
    number of layers. With ``backward`` (default) the gradients cross the same boundaries: twice that.
    """
    _nonneg("num_nodes", num_nodes)
    _count("num_gpus", num_gpus, 1)
    _nonneg("dim", dim)
    return (2 if backward else 1) * (num_gpus - 1) * num_nodes * dim * _elsize(elsize)


def comm_layer_hybrid(alpha_h: float, num_layers: int, num_nodes: int, hidden: Number, num_stages: int, *,
                      backward: bool = True, elsize: int = 4) -> float:
    r"""Communication of GNNPipe's layer x graph hybrid, **bytes** per training step (GNNPipe §3.5).

    .. math:: 2\alpha_h \mathcal{L}\mathcal{N}\mathcal{H} + 2(S_h - 1)\mathcal{N}\mathcal{H}

    - ``num_stages`` = :math:`S_h` pipeline stages of consecutive layers, each stage running graph
      parallelism over :math:`\mathcal{W}` partitions (:math:`\mathcal{M} = \mathcal{W}S` GPUs);
    - ``num_nodes`` = :math:`\mathcal{N}` vertices, ``hidden`` = :math:`\mathcal{H}` hidden units (the
      same at every layer), ``num_layers`` = :math:`\mathcal{L}`;
    - ``alpha_h`` = :math:`\alpha_h`, GNNPipe's replication factor of the :math:`\mathcal{W}`-way
      partition. GNNPipe's graph term is :math:`\alpha\mathcal{L}\mathcal{N}\mathcal{H}` per pass, so
      its :math:`\alpha` counts *remote* copies per vertex (0 with one partition); for a replication
      factor counting masters too (NeutronTask's, :attr:`Partition.replication_factor`), pass
      ``alpha - 1``.

    The first term is graph (halo) communication, the second the inter-stage transfers (all
    :math:`\mathcal{N}` embeddings across each of the :math:`S_h - 1` stage boundaries). The paper's
    coefficient 2 counts forward and backward; ``backward=False`` halves both terms. Special cases:
    graph parallelism :math:`S_h = 1`, layer-level model parallelism :math:`\alpha_h = 0`.
    """
    _nonneg("alpha_h", alpha_h)
    _count("num_layers", num_layers)
    _nonneg("num_nodes", num_nodes)
    _nonneg("hidden", hidden)
    _count("num_stages", num_stages, 1)
    k = 2 if backward else 1
    return (k * alpha_h * num_layers * num_nodes * hidden + k * (num_stages - 1) * num_nodes * hidden) * _elsize(elsize)


def _wire_fraction(num_workers: Optional[int]) -> float:
    """``(N - 1) / N``: the part of an all-to-all-redistributed tensor that leaves its GPU; 1 if ``N`` is unknown."""
    if num_workers is None:
        return 1.0
    _count("num_workers", num_workers, 1)
    return (num_workers - 1) / num_workers


def comm_tensor(num_nodes: int, dim: Number, num_layers: int, *, num_workers: Optional[int] = None,
                decoupled: bool = False, backward: bool = True, elsize: int = 4) -> float:
    r"""Split/gather volume of GNN tensor parallelism, **bytes** (NeutronTP §3.2 and §4.1).

    Coupled (§3.2): every layer gathers (dimension slices -> whole rows, before the NN ops) and splits
    (rows -> slices, after them) the embeddings of all vertices; the total forward load is
    :math:`N \cdot 2(N-1)\frac{V}{N}\frac{D}{N} L = 2\frac{N-1}{N} V D L \approx 2VDL` elements
    (``num_nodes`` = :math:`V`, ``dim`` = :math:`D` uniform width, ``num_layers`` = :math:`L`,
    ``num_workers`` = :math:`N`). Without ``num_workers`` the paper's asymptotic :math:`2VDL` is
    returned (factor :math:`(N-1)/N` taken as 1).

    Decoupled (§4.1, Fig. 8): the :math:`L` NN operations run first on whole rows, then one split, the
    :math:`L` aggregations on slices, one gather: 2 collectives forward and 2 backward, "4 rounds of
    collective communication regardless of the number of model layers", i.e.
    :math:`4\frac{N-1}{N}VD` per step (``num_layers`` is then ignored; ``dim`` is the width of the
    aggregated embeddings, usually the small output width).

    ``backward`` (default) adds the gradients' collectives: the coupled count doubles to
    :math:`4\frac{N-1}{N}VDL`; ``backward=False`` is the paper's forward count. Fig. 8 counts
    :math:`2L - 1` coupled rounds per direction (no split after the last layer): the closed form
    overcounts that by one collective per direction.
    """
    _nonneg("num_nodes", num_nodes)
    _nonneg("dim", dim)
    _count("num_layers", num_layers)
    f = _wire_fraction(num_workers)
    collectives = 2 if decoupled else 2 * num_layers
    if backward:
        collectives *= 2
    return collectives * f * num_nodes * dim * _elsize(elsize)


def comm_mop(num_nodes: int, dims: Sequence[Number], *, num_workers: Optional[int] = None, backward: bool = True,
             elsize: int = 4) -> float:
    r"""All-to-all volume of MixGCN's mixture of parallelism, **bytes** (MixGCN §3.1.2, Prop. 3.4).

    MoP (Algorithm 2) aggregates on feature slices and updates on node rows. Layer
    :math:`l = 0..L-1`: aggregation workers compute dimension slices of
    :math:`Z^{(l)} = \hat A H^{(l)}` (:math:`N \times d^{(l)}`); an all-to-all hands each update
    worker whole rows of :math:`Z^{(l)}`; it computes :math:`H^{(l+1)} = \sigma(W^{(l)}Z^{(l)})`
    (:math:`N \times d^{(l+1)}`) on its rows; a second all-to-all returns slices of :math:`H^{(l+1)}`
    for the next layer's aggregation, not needed after the last layer (the loss is computed on rows).
    Forward, in elements:

    .. math:: f \cdot N \Big(\sum_{l=0}^{L-1} d^{(l)} + \sum_{l=1}^{L-1} d^{(l)}\Big)

    ``num_nodes`` = :math:`N` (MixGCN's node-set size), ``dims`` = :math:`(d^{(0)}, \dots, d^{(L)})`
    (input features to output, ``L = len(dims) - 1``), :math:`f = (m-1)/m` the part of each
    redistributed tensor that leaves its worker for ``num_workers`` = :math:`m` (1 if not given).
    Nodes are never replicated, so the volume is :math:`O(N)`, independent of :math:`m` (Prop. 3.4).
    The initial feature split of :math:`H^{(0)}` is a one-off layout of the input, not counted.
    ``backward`` (default) adds the gradients of every all-to-all except the first
    (:math:`Z^{(0)} = \hat A X` needs no gradient): :math:`f N (\sum_{l=1}^{L-1} d^{(l)}) \cdot 2`.
    """
    _nonneg("num_nodes", num_nodes)
    d = _dims("dims", dims, 2)
    f = _wire_fraction(num_workers)
    num_layers = len(d) - 1
    forward = sum(d[:num_layers]) + sum(d[1:num_layers])
    back = 2 * sum(d[1:num_layers]) if backward else 0
    return f * num_nodes * (forward + back) * _elsize(elsize)


# --------------------------------------------------------------------------- collectives (alpha-beta)
def p2p_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """Point-to-point send of ``nbytes``: ``latency + nbytes / bandwidth`` (Hockney); 0 for no bytes."""
    _nonneg("nbytes", nbytes)
    _pos("bandwidth", bandwidth)
    _nonneg("latency", latency)
    return latency + nbytes / bandwidth if nbytes else 0.0


def _ring_check(nbytes: float, n: int, bandwidth: float, latency: float) -> None:
    _nonneg("nbytes", nbytes)
    _count("n", n, 1)
    _pos("bandwidth", bandwidth)
    _nonneg("latency", latency)


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of an ``nbytes`` buffer over ``n`` ranks: ``2 (n - 1) (latency + nbytes / (n bandwidth))``.

    A reduce-scatter then an all-gather, each ``n - 1`` steps moving one ``nbytes / n`` chunk per rank
    over a full-duplex link. 0 when ``n == 1``.
    """
    _ring_check(nbytes, n, bandwidth, latency)
    return 2 * (n - 1) * (latency + nbytes / (n * bandwidth))


def ring_allgather_time(total_bytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather of a ``total_bytes`` result (``total_bytes / n`` from each rank), seconds.

    ``(n - 1) (latency + total_bytes / (n bandwidth))``; 0 when ``n == 1``.
    """
    _ring_check(total_bytes, n, bandwidth, latency)
    return (n - 1) * (latency + total_bytes / (n * bandwidth))


def ring_reduce_scatter_time(total_bytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring reduce-scatter of a ``total_bytes`` input per rank (``total_bytes / n`` kept), seconds.

    Same cost as the all-gather: ``(n - 1) (latency + total_bytes / (n bandwidth))``.
    """
    _ring_check(total_bytes, n, bandwidth, latency)
    return (n - 1) * (latency + total_bytes / (n * bandwidth))


def all_to_all_time(send_bytes: Sequence[float], recv_bytes: Sequence[float], bandwidth: float,
                    latency: float) -> float:
    """One rank's all-to-all as a pairwise exchange over a full-duplex link, seconds.

    ``send_bytes[j]`` / ``recv_bytes[j]``: bytes to / from peer ``j`` (the rank's own entry should be
    0). Time = ``(number of peers with a non-empty send or receive) * latency +
    max(sum(send), sum(recv)) / bandwidth``: one message set-up per peer exchanged with, and sending
    and receiving proceed at the same time. 0 with nothing to move (e.g. one rank).
    """
    send, recv = list(send_bytes), list(recv_bytes)
    if len(send) != len(recv):
        raise PlanningError(f"send_bytes has {len(send)} peers but recv_bytes has {len(recv)}")
    for i, (s, r) in enumerate(zip(send, recv)):
        _nonneg(f"send_bytes[{i}]", s)
        _nonneg(f"recv_bytes[{i}]", r)
    peers = sum(1 for s, r in zip(send, recv) if s or r)
    return all_to_all_totals_time(peers, sum(send), sum(recv), bandwidth, latency)


def all_to_all_totals_time(peers: int, send_total: float, recv_total: float, bandwidth: float,
                           latency: float) -> float:
    """:func:`all_to_all_time` from its totals: ``peers`` exchanged with (a non-empty send or
    receive), ``send_total`` / ``recv_total`` bytes sent and received in all."""
    _nonneg("peers", peers)
    _nonneg("send_total", send_total)
    _nonneg("recv_total", recv_total)
    _pos("bandwidth", bandwidth)
    _nonneg("latency", latency)
    return peers * latency + max(send_total, recv_total, 0) / bandwidth


def halo_exchange_time(send_rows: Sequence[int], recv_rows: Sequence[int], width: int, bandwidth: float,
                       latency: float, *, elsize: int = 4, grad: bool = False) -> float:
    """One rank's halo exchange: :func:`all_to_all_time` of ``rows * width * elsize`` bytes per peer.

    ``send_rows[j]`` / ``recv_rows[j]``: halo rows this rank sends to / receives from peer ``j``;
    ``width`` elements per row. ``grad=True`` is the backward (halo gradients return to their
    owners): the directions swap.
    """
    _nonneg("width", width)
    es = _elsize(elsize)
    out = [r * width * es for r in send_rows]
    into = [r * width * es for r in recv_rows]
    if grad:
        out, into = into, out
    return all_to_all_time(out, into, bandwidth, latency)


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``: ``2 (n - 1) nbytes // n``.

    The runtime's accounting (:meth:`gnncompile.runtime.comm.Communicator.all_reduce_`) and the data
    lowering's predictions use this exact integer convention. 0 when ``n == 1``.
    """
    _count("nbytes", nbytes)
    _count("n", n, 1)
    return 2 * (n - 1) * nbytes // n


def ring_allgather_bytes(total_bytes: int, n: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-gather of ``total_bytes``: ``(n - 1) total_bytes // n``."""
    _count("total_bytes", total_bytes)
    _count("n", n, 1)
    return (n - 1) * total_bytes // n


def ring_reduce_scatter_bytes(total_bytes: int, n: int) -> int:
    """Bytes one rank sends (and receives) in a ring reduce-scatter of ``total_bytes``: ``(n - 1) total_bytes // n``."""
    return ring_allgather_bytes(total_bytes, n)


# --------------------------------------------------------------------------- GSPLIT (sampled mini-batches)
def _distinct(draws: float, population: float) -> float:
    """Expected distinct items among ``draws`` uniform draws (with replacement) from ``population``."""
    if population <= 0 or draws <= 0:
        return 0.0
    return population * -math.expm1(-draws / population)


def sampled_sizes(num_nodes: int, degree_mean: float, seeds: Number, fanouts: Sequence[int]
                  ) -> list[tuple[float, float]]:
    """Expected ``(vertices, edges)`` of every layer of a mini-batch of ``seeds`` targets sampled with
    ``fanouts`` (input layer first; ``-1``: all), from the graph's size and mean degree alone.

    Entry ``i`` (``0 .. L``) holds ``|V_i|``, block ``i``'s sources (``V_L``: the seeds), and the
    edges of block ``i`` (0 for ``i = L``). A destination keeps ``min(d, f_i)`` in-edges (``d``:
    the mean degree; by Jensen an upper bound of ``E[min(D, f_i)]``), whose sources are drawn
    uniformly from the vertices: ``V_i`` is ``V_{i+1}`` plus the expected distinct new ones,
    ``(N - |V_{i+1}|) (1 - exp(-e_i / N))``. Skewed degrees make real batches smaller (hubs are
    drawn again and again); presampling a graph measures them instead.
    """
    n = _count("num_nodes", num_nodes)
    d = _nonneg("degree_mean", degree_mean)
    rows = float(min(_nonneg("seeds", seeds), n))
    out = [(rows, 0.0)]
    for f in reversed(list(fanouts)):
        if f == 0 or f < -1:
            raise PlanningError(f"sampled_sizes: a fanout is >= 1 or -1, got {f}")
        edges = rows * (d if f == -1 else min(d, f))
        rows = rows + (_distinct(edges, n) * (n - rows) / n if n else 0.0)
        out.append((rows, edges))
    out.reverse()  # out[i] = (|V_i|, edges of block i); the seeds' entry has no block
    return out


def split_remote_rows(sources: float, edges: float, num_parts: int, cut: float) -> float:
    """Expected rows one of ``num_parts`` splits receives in a layer's shuffle: the distinct remote
    sources of its ``edges / num_parts`` sampled edges, a fraction ``cut`` of which cross splits,
    drawn uniformly from the ``sources`` (the layer's vertex set) the other splits own."""
    p = _count("num_parts", num_parts, 1)
    if not 0.0 <= cut <= 1.0:
        raise PlanningError(f"split_remote_rows: cut must be in [0, 1], got {cut}")
    if p == 1:
        return 0.0
    return _distinct(cut * _nonneg("edges", edges) / p, _nonneg("sources", sources) * (1.0 - 1.0 / p))
