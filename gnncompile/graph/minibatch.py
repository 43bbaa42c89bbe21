"""Sampled mini-batches of a run and their split across ranks (GSPLIT's online splitting).

The batches of an epoch and each batch's sample are functions of ``(seed, epoch, step)`` alone
(:func:`epoch_order`, :func:`batch_generator`): the single-device reference and every rank of a
plan draw the same ones without talking, and a resumed run continues the same sequence.

:func:`split_step` cuts one sampled mini-batch into non-overlapping splits by a vertex -> rank map
(GSPLIT §3): at every depth ``d`` rank ``r`` holds the rows of ``V_d`` (block ``d``'s sources;
``V_L``: the seeds) owned by ``r``, in ``V_d``'s order, so its rows of ``V_{d+1}`` are a prefix of
its rows of ``V_d`` as in a whole block. Its block of layer ``i`` has its rows of ``V_{i+1}`` as
destinations with all their sampled in-edges, its own rows of ``V_i`` as the first sources and
the remote sources after them, grouped by owner; the *shuffle index* of that layer says which of
its rows each rank sends to each other rank (a halo exchange per layer, forward and backward).
Coefficients are the whole mini-batch block's, so the split computes exactly what one device
computes on the sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..errors import GraphError
from .core import Graph
from .sampling import SampledBatch, sample_blocks
from .core import NormScales
from .shard import LocalGraph, propagation_scales, segment_ranges, slice_rows

__all__ = ["epoch_order", "batch_generator", "num_batches", "batch_seeds", "RankStep", "split_step",
           "micro_step", "SampledSteps", "full_blocks", "DropoutIndex", "batch_dropout_positions"]


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (SplitMix64 steps), so nearby tuples give unrelated streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def epoch_order(targets: torch.Tensor, seed: int, epoch: int) -> torch.Tensor:
    """``targets`` in epoch ``epoch``'s random order (a function of ``seed`` and ``epoch``)."""
    gen = torch.Generator().manual_seed(_mix(seed, epoch, 0x0B))
    return targets.index_select(0, torch.randperm(targets.numel(), generator=gen).to(targets.device))


def num_batches(num_targets: int, batch_size: int) -> int:
    """Steps of an epoch: ``ceil(num_targets / batch_size)``."""
    return -(-num_targets // batch_size)


def batch_seeds(order: torch.Tensor, batch_size: int, step: int) -> torch.Tensor:
    """The seeds of batch ``step`` of an epoch's ``order`` (the last batch holds the rest)."""
    return order[step * batch_size:(step + 1) * batch_size]


def batch_generator(seed: int, epoch: int, step: int, stream: int = 0) -> torch.Generator:
    """The CPU generator that samples batch ``step`` of epoch ``epoch`` (``stream``: a rank's own
    micro-batch in mini-batch data parallelism; 0 for the whole batch)."""
    return torch.Generator().manual_seed(_mix(seed, epoch, step, stream, 0x5A))


@dataclass
class RankStep:
    """One rank's inputs of one sampled training step.

    ``blocks``: its graph of every layer (input layer first); ``x``: the features of its rows of
    ``V_0``; ``seeds``/``labels``: the global ids and labels of the seeds it scores; ``halos``: per
    layer, ``(send_index per rank, recv_count per rank)`` of the exchange that completes that
    layer's sources (empty for a rank's own micro-batch); ``batch_size``: the seeds of the whole
    step (the loss divides by it); ``rows``: its rows at every depth ``0..L``; ``dropout_index``:
    by model input name, the positions of its rows among the rows of the whole mini-batch it
    computes a part of (:func:`batch_dropout_positions`: what replicated dropout masks read).
    """

    blocks: list[LocalGraph]
    x: torch.Tensor
    seeds: torch.Tensor
    labels: Optional[torch.Tensor]
    halos: list[tuple[tuple[torch.Tensor, ...], tuple[int, ...]]]
    batch_size: int
    rows: list[int] = field(default_factory=list)
    dropout_index: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> "RankStep":
        def send(idx: tuple[tuple[torch.Tensor, ...], tuple[int, ...]]):
            return tuple(t.to(device) for t in idx[0]), idx[1]
        return RankStep([b.to(device) for b in self.blocks], self.x.to(device), self.seeds.to(device),
                        None if self.labels is None else self.labels.to(device), [send(h) for h in self.halos],
                        self.batch_size, list(self.rows), {k: v.to(device) for k, v in self.dropout_index.items()})


#: a replicated dropout's index input of a sampled plan: ``(input name, row space, level)``
#: (``V``: depth ``0..L``; ``E``, ``E+V``: block; ``nnz``: the input features, level 0)
DropoutIndex = tuple[str, str, int]


def batch_dropout_positions(wanted: Sequence[DropoutIndex], batch: SampledBatch, graph: Graph,
                      mine: Optional[Sequence[torch.Tensor]] = None,
                      eids: Optional[Sequence[torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """The positions, among the whole mini-batch ``batch``'s rows, of the rows a rank holds, for
    each index input in ``wanted``: ``mine[d]`` its positions in ``V_d`` (depth ``0..L``) and
    ``eids[i]`` its edges' positions in block ``i`` (``None``: every row, as for a rank's own
    micro-batch). ``E+V`` rows are a block's edges, then one per destination (the self loops a
    propagation adds); ``nnz`` rows the stored values of the sparse input features' rows."""
    out = {}
    for name, space, level in wanted:
        if space == "V":
            rows = batch.src_ids[level].numel() if level < batch.num_layers else batch.seed_ids.numel()
            out[name] = torch.arange(rows) if mine is None else mine[level]
            continue
        if space == "nnz":
            crow = graph.x.crow_indices()
            counts = (crow[1:] - crow[:-1]).index_select(0, batch.input_ids)
            starts = torch.cumsum(counts, 0) - counts
            out[name] = torch.arange(int(counts.sum())) if mine is None else \
                segment_ranges(starts.index_select(0, mine[0]), counts.index_select(0, mine[0]))
            continue
        block = batch.blocks[level]
        edges = torch.arange(block.num_edges) if eids is None else eids[level]
        if space == "E":
            out[name] = edges
        elif space == "E+V":
            dst = torch.arange(block.num_nodes) if mine is None else mine[level + 1]
            out[name] = torch.cat([edges, block.num_edges + dst])
        else:
            raise GraphError(f"unknown dropout space {space!r} of input {name!r} (expected V, E, E+V or nnz)")
    return out


def _features(graph: Graph, ids: torch.Tensor) -> torch.Tensor:
    if graph.x is None:
        raise GraphError(f"x: graph {graph.name!r} has no node features; training needs them")
    return slice_rows(graph.x, ids)


def micro_step(graph: Graph, seeds: torch.Tensor, fanouts: Sequence[int], generator: torch.Generator,
               norms: Sequence[tuple[str, bool]], batch_size: int, dropout: Sequence[DropoutIndex] = ()) -> RankStep:
    """A rank's own micro-batch (mini-batch data parallelism): ``seeds`` sampled on their own;
    ``dropout``: the index inputs to compute (every row of the micro-batch: the rank holds it whole)."""
    b = sample_blocks(graph, seeds, fanouts, generator=generator, norms=norms)
    return RankStep(b.blocks, _features(graph, b.input_ids), seeds,
                    None if graph.y is None else graph.y.index_select(0, seeds), [((), ())] * b.num_layers,
                    batch_size, [int(t.numel()) for t in b.src_ids] + [int(seeds.numel())],
                    batch_dropout_positions(dropout, b, graph))


def _depth_owners(batch: SampledBatch, parts: torch.Tensor) -> list[torch.Tensor]:
    """Owner rank of every row of ``V_0 .. V_L``."""
    return [parts.index_select(0, ids) for ids in batch.src_ids] + [parts.index_select(0, batch.seed_ids)]


def split_step(graph: Graph, batch: SampledBatch, parts: torch.Tensor, num_parts: int, rank: int,
               dropout: Sequence[DropoutIndex] = ()) -> RankStep:
    """Rank ``rank``'s split of the sampled mini-batch ``batch`` under the vertex -> rank map
    ``parts`` (module docstring). Every rank computes its own split from the same batch; the
    shuffle index it sends by is the one its peers receive by. ``dropout``: the index inputs to
    compute (:func:`batch_dropout_positions`)."""
    L = batch.num_layers
    owners = _depth_owners(batch, parts)
    mine = [torch.nonzero(o == rank).flatten() for o in owners]  # positions of my rows at every depth
    blocks: list[LocalGraph] = []
    halos = []
    edge_positions = []
    for i, block in enumerate(batch.blocks):
        n_src = block.num_src
        local = torch.full((n_src,), -1, dtype=torch.int64)
        local[mine[i]] = torch.arange(mine[i].numel())
        # every cross edge's (receiver, source row), distinct, ordered by receiver, owner, position
        dst_pos_all = torch.repeat_interleave(torch.arange(block.num_nodes), block.indptr.diff())
        recv_all = owners[i + 1].index_select(0, dst_pos_all)
        src_own_all = owners[i].index_select(0, block.indices)
        cross = recv_all != src_own_all
        key = torch.unique((recv_all[cross] * num_parts + src_own_all[cross]) * n_src + block.indices[cross])
        recv, owner, src = key // (num_parts * n_src), (key // n_src) % num_parts, key % n_src
        # what I receive: my remote sources, grouped by owner (ascending), ascending position
        got = recv == rank
        halo_src, halo_owner = src[got], owner[got]
        local[halo_src] = mine[i].numel() + torch.arange(halo_src.numel())
        recv_count = tuple(int((halo_owner == q).sum()) for q in range(num_parts))
        # what I send: my rows that each other rank receives, in its order
        sent = owner == rank
        send_index = tuple(local.index_select(0, src[sent & (recv == q)]) for q in range(num_parts))
        halos.append((send_index, recv_count))
        # my destinations (a prefix of my sources) with all their sampled in-edges
        dst = mine[i + 1]
        starts = block.indptr.index_select(0, dst)
        counts = block.indptr.index_select(0, dst + 1) - starts
        eids = segment_ranges(starts, counts)
        edge_positions.append(eids)
        indptr = torch.zeros(dst.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=indptr[1:])
        indices = local.index_select(0, block.indices.index_select(0, eids))
        sources = torch.cat([mine[i], halo_src])
        scales = {k: sc.select(dst, sources) for k, sc in block._scales.items()}
        weight = None if block.edge_weight is None else block.edge_weight.index_select(0, eids)
        blocks.append(LocalGraph(indptr, indices, int(dst.numel()), int(sources.numel()),
                                 edge_weight=weight, scales=scales,
                                 name=f"{graph.name}[block {i}, rank {rank}]"))
    seeds = batch.seed_ids.index_select(0, mine[L])
    x = _features(graph, batch.input_ids.index_select(0, mine[0]))
    return RankStep(blocks, x, seeds, None if graph.y is None else graph.y.index_select(0, seeds), halos,
                    int(batch.seed_ids.numel()), [int(m.numel()) for m in mine],
                    batch_dropout_positions(dropout, batch, graph, mine, edge_positions))


def full_blocks(graph: Graph, targets: torch.Tensor, num_layers: int, norms: Sequence[tuple[str, bool]],
                scales: Optional[dict[tuple[str, bool], NormScales]] = None) -> SampledBatch:
    """The blocks of ``targets``' whole ``num_layers``-hop neighbourhood with the *whole graph's*
    normalization: on them a bound model computes exactly what the model computes on ``graph`` at
    ``targets`` (full-neighbour evaluation). ``scales``: ``graph``'s
    :func:`~gnncompile.graph.shard.propagation_scales` of ``norms`` when the caller has them."""
    b = sample_blocks(graph, targets, [-1] * num_layers)
    scales = scales if scales is not None else propagation_scales(graph, norms)
    blocks = []
    for i, block in enumerate(b.blocks):
        dst, src = b.dst_ids(i), b.src_ids[i]
        blocks.append(LocalGraph(block.indptr, block.indices, block.num_nodes, block.num_src,
                                 edge_weight=block.edge_weight,
                                 scales={k: sc.select(dst, src) for k, sc in scales.items()},
                                 name=f"{graph.name}[full block {i}]"))
    return SampledBatch(blocks, b.src_ids, b.edge_ids)


@dataclass
class SampledSteps:
    """One plan rank's source of sampled training steps (its step-input provider asks it for each).

    ``graph`` holds what sampling and loading read (structure, features, labels); ``targets`` the
    training vertices. An epoch has :attr:`steps_per_epoch` steps; step ``i`` of epoch ``e``
    samples batch ``i`` of :func:`epoch_order` with :func:`batch_generator`. With ``parts`` (a
    vertex -> rank map) the rank takes its split of the one mini-batch (``split``); without, its
    own micro-batch: the ``rank``-th of ``num_ranks`` contiguous parts of the batch's seeds, sampled
    with its own stream (mini-batch data parallelism).
    """

    graph: Graph
    targets: torch.Tensor
    batch_size: int
    fanouts: tuple[int, ...]
    seed: int
    norms: tuple[tuple[str, bool], ...]
    rank: int
    num_ranks: int
    parts: Optional[torch.Tensor] = None
    #: the replicated dropouts' index inputs each step computes (:func:`batch_dropout_positions`)
    dropout: tuple[DropoutIndex, ...] = ()

    @property
    def steps_per_epoch(self) -> int:
        return num_batches(int(self.targets.numel()), self.batch_size)

    def seeds(self, epoch: int, step: int) -> torch.Tensor:
        """The seeds of the whole step (every rank's)."""
        return batch_seeds(epoch_order(self.targets, self.seed, epoch), self.batch_size, step)

    def sample(self, epoch: int, step: int) -> SampledBatch:
        """The whole mini-batch of a step (what ``split`` cuts; single-device training's batch)."""
        return sample_blocks(self.graph, self.seeds(epoch, step), self.fanouts,
                             generator=batch_generator(self.seed, epoch, step), norms=self.norms)

    def step(self, epoch: int, step: int, batch: Optional[SampledBatch] = None) -> RankStep:
        """This rank's inputs of step ``step`` of epoch ``epoch`` (on the CPU); ``batch``: the step's
        whole mini-batch when the caller has sampled it already (split)."""
        if self.parts is not None:
            batch = self.sample(epoch, step) if batch is None else batch
            return split_step(self.graph, batch, self.parts, self.num_ranks, self.rank, self.dropout)
        seeds = self.seeds(epoch, step)
        mine = torch.tensor_split(seeds, self.num_ranks)[self.rank]
        return micro_step(self.graph, mine, self.fanouts, batch_generator(self.seed, epoch, step, 1 + self.rank),
                          self.norms, int(seeds.numel()), self.dropout)
