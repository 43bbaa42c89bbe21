"""``replicate_dropout_masks``: every training-mode dropout uses the whole tensor's mask (exact).

A rank that holds some rows of a tensor draws the seed of the *whole* tensor's mask from the common
RNG stream and computes that mask's rows it holds (:func:`~gnncompile.ops.dropout_rows`, a
counter-based generator), so distributed training sees the masks single-device training sees, bit
for bit (the strategies' ``dropout="replicated"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F

from ..errors import PlanningError
from ..frontend.blocks import value_depths
from ..frontend.ops import dropout_rows, mask_generator
from ..graph.core import Graph
from ..ir.symbolic import Lin
from ..ir.tpgraph import TPGraph, TPInfo
from ..nn.functional import feature_dropout
from .infra import graph_pass
from .lower import StagedModel, _elsize, call_arguments
from .recompute import Recompute, draws_random_numbers

__all__ = ["replicate_dropout_masks", "dropout_inputs", "dropout_draws", "unreplicated_draws", "drawing_ops",
           "INDEX_INPUTS", "INDEX_META", "sampled_index_input", "sampled_index_inputs"]

#: row space -> the model input holding a rank's global rows of that space
INDEX_INPUTS = {"V": "dropout_index_v", "E": "dropout_index_e", "E+V": "dropout_index_ev",
                "nnz": "dropout_index_nnz"}


def sampled_index_input(space: str, level: int) -> str:
    """The model input of a sampled plan that holds a rank's positions in the whole mini-batch's
    ``space`` rows at ``level`` (``V``: depth ``0..L``; ``E``, ``E+V``: the block's index;
    ``nnz``: the input features, level 0): ``dropout_index_v2``, ``dropout_index_ev0``..."""
    return f"{INDEX_INPUTS[space]}{level}"


#: ``node.meta`` key of an index input :func:`replicate_dropout_masks` added: ``(space, level)``
#: (level ``None`` for a whole-graph index)
INDEX_META = "dropout_index"


def sampled_index_inputs(tp: TPGraph) -> tuple[tuple[str, str, int], ...]:
    """The sampled-plan index inputs of ``tp`` (:func:`sampled_index_input`) as ``(name, space,
    level)``, what :class:`~gnncompile.graph.minibatch.SampledSteps` computes each step."""
    return tuple((n.name, *n.meta[INDEX_META]) for n in tp.graph.nodes
                 if n.op == "placeholder" and n.meta.get(INDEX_META, (None, None))[1] is not None)


def _dropout_of(tp: TPGraph, n: torch.fx.Node) -> Optional[tuple[torch.fx.Node, float]]:
    """``(input, p)`` if ``n`` is a training-mode dropout that draws a mask, else ``None``."""
    if n.op == "call_function" and n.target in (F.dropout, feature_dropout):
        a = call_arguments(n)
        inp = a.get("input", a.get("x"))
        if a["training"] and float(a["p"]) > 0 and isinstance(inp, torch.fx.Node):
            return inp, float(a["p"])
    elif n.op == "call_module":
        mod = tp.get_submodule(n.target)
        if isinstance(mod, torch.nn.Dropout) and mod.training and mod.p > 0 and n.args:
            return n.args[0], float(mod.p)
    return None


#: leaf modules that draw random numbers in training mode (nn.Dropout's masks are replicated)
_RANDOM_MODULES = (torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout, torch.nn.Dropout1d, torch.nn.Dropout2d,
                   torch.nn.Dropout3d, torch.nn.RReLU)


def unreplicated_draws(tp: TPGraph) -> list[str]:
    """The ops of ``tp`` that draw random numbers other than the masks :func:`replicate_dropout_masks`
    replicates (``torch.randn_like`` noise, ``F.alpha_dropout``, ``nn.Dropout1d``, a mask drawn by
    hand with ``torch.rand_like``...): ranks seeded alike would draw the same numbers for their
    different rows. Ops that draw nothing as called (``training=False``, ``p=0``) are not listed."""
    modules = dict(tp.named_modules())
    found = []
    for n in tp.graph.nodes:
        if n.op == "call_module":
            if isinstance(modules[n.target], _RANDOM_MODULES) and modules[n.target].training:
                found.append(n.name)
            continue
        if n.op not in ("call_function", "call_method") or n.target is dropout_rows \
                or not draws_random_numbers(n, modules):
            continue
        if n.op == "call_function" and n.target in (F.dropout, feature_dropout) and _dropout_of(tp, n) is None:
            continue
        try:
            args = call_arguments(n) if n.op == "call_function" else {}
        except (TypeError, ValueError):  # (no signature to bind: counted as drawing)
            args = {}
        if args.get("training", True) is False or args.get("p", 1) == 0:
            continue
        found.append(n.name)
    return found


def drawing_ops(tp: TPGraph) -> list[str]:
    """Every op of ``tp`` that draws random numbers as called: its dropouts that draw a mask and
    :func:`unreplicated_draws` (for an evaluation trace: ``F.dropout(x, p)`` without
    ``training=self.training`` drops out in eval mode too)."""
    masks = [n.name for n in tp.graph.nodes if _dropout_of(tp, n) is not None]
    return masks + [n for n in unreplicated_draws(tp) if n not in masks]


def _mark_replays(g: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node, inp: torch.fx.Node) -> None:
    """Where the input of dropout ``old`` is held anyway, make ``new`` (its replacement) replay its
    output, and record on each of its users that saves it that the runtime computes that output
    again in backward (:func:`~gnncompile.frontend.ops.replay_dropout_outputs`,
    where ``frontend.ops._replayable_source`` holds): the user holds the dropout's input and mask
    instead. The input is no new memory where another op saves it too (``relu``'s output) or it is
    a model input (the features); the mask none where the dropout's backward saves it (its input
    needs a gradient), else its bytes (one per element)."""
    t = old.meta.get("tp")
    if t is None or not t.dtype:
        return
    masked = t.saved_bytes != Lin()  # the dropout saves its mask: its input needs a gradient
    if inp.op != "placeholder" and not masked:
        return  # not replayed: neither a step input nor an input needing a gradient
    held = inp.op == "placeholder" or any(
        inp.name in m.meta["tp"].saves for m in g.nodes if m is not old and "tp" in m.meta)
    if not held:
        return  # the input would be held instead of the output: no less memory, one more pass
    out = t.bytes_written
    saving = out - (Lin() if masked else out * (1.0 / _elsize(t.dtype)))
    users = [u for u in old.users if u.meta.get("tp") is not None and old.name in u.meta["tp"].saves]
    if users:
        new.kwargs = {"replay": True}
    for u in users:
        ut = u.meta["tp"]
        u.meta["tp"] = ut.with_(saves=tuple(sorted({*ut.saves} - {old.name} | {new.name, inp.name})),
                                replays=ut.replays + (new.name,), replayed_bytes=ut.replayed_bytes + out,
                                replay_saving=ut.replay_saving + saving)


def dropout_inputs(tp: TPGraph) -> dict[str, str]:
    """The dropout-index inputs :func:`replicate_dropout_masks` added to ``tp``, with their row spaces."""
    return {n.name: n.meta[INDEX_META][0] for n in tp.graph.nodes if n.op == "placeholder" and INDEX_META in n.meta}


@graph_pass(exact=True)
def replicate_dropout_masks(tp: TPGraph, graph: Graph, strategy: str = "",
                            allowed: Optional[tuple[str, ...]] = None, sampled: bool = False) -> TPGraph:
    """Rewrite every training-mode dropout into :func:`~gnncompile.ops.dropout_rows` over the whole graph.

    ``allowed``: the row spaces (``V``, ``E``, ``E+V``, ``nnz``) whose masks ``strategy`` can hand
    its ranks (default: all). ``sampled``: for a sampled mini-batch plan, whose "whole tensor" is
    the mini-batch's: each dropout reads the input :func:`sampled_index_input` of its space and
    level (a rank's positions among the mini-batch's rows there) and bounds its rows by the
    graph's (a mask's row does not depend on the tensor's length).

    Requires:
        ``tp`` traced for ``graph``; every dropout of a space in ``allowed``, else
        :class:`PlanningError` naming the space.
    Ensures:
        Each dropout of a V-, E- or (E+V)-space value (or of sparse input features) reads a model
        input ``dropout_index_<space>`` (the global rows a rank holds; :func:`dropout_inputs`
        lists them) and draws the mask of the global tensor. A dropout whose input is held anyway
        (saved by another op, or a model input) and whose output an op saves replays that output
        (``replay=True``): the saving op's annotation records it (``TPInfo.replays``).
    Preserves:
        The function computed on one rank holding every row (identity index), including the RNG
        calls, so a rank's masks equal single-device training's for the same seed. Exact.
    """
    g = tp.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    inputs: dict[str, torch.fx.Node] = {}
    spaces: dict[str, str] = {}
    sizes = {"V": graph.num_nodes, "E": graph.num_edges, "E+V": graph.num_edges + graph.num_nodes}
    x = getattr(graph, "x", None)  # GraphStats: none (planned from statistics, dense features)
    if x is not None and x.layout == torch.sparse_csr:
        sizes["nnz"] = int(x.values().numel())
    depths = value_depths(tp) if sampled else {}
    for n in list(g.nodes):
        found = _dropout_of(tp, n)
        if found is None:
            continue
        inp, p = found
        info = inp.meta.get("tp")
        space = "nnz" if inp.op == "placeholder" and "nnz" in sizes else (info.space if info is not None else "?")
        if space not in sizes:
            raise PlanningError(f"op {n.name!r}: dropout of a value with rows {space!r} cannot draw the whole "
                                "graph's mask; use dropout='local'")
        name = INDEX_INPUTS[space]
        if sampled and mask_generator() == "torch":
            raise PlanningError(f"op {n.name!r}: a sampled plan replicates dropout masks with the counter-based "
                                "generator (a mask's rows on their own); GNNCOMPILE_DROPOUT_MASKS=torch draws whole "
                                "masks: unset it, or pass dropout='local'")
        level = None
        if sampled:  # V: the value's depth; E, E+V: its layer's block; nnz: the input features
            if space == "V" and inp.name not in depths:
                raise PlanningError(f"op {n.name!r}: the depth of {inp.name!r} in the mini-batch is unknown")
            level = depths[inp.name] if space == "V" else info.layer - 1 if space in ("E", "E+V") else 0
            name = sampled_index_input(space, level)
        if name not in inputs:
            with g.inserting_after(placeholders[-1]):
                ph = g.placeholder(name)
            # a sampled plan's index is no vertex value of the model (block binding leaves it alone)
            ph.meta["tp"] = TPInfo(kind="input", dtype="int64", op="placeholder") if sampled \
                else placeholders[-1].meta.get("tp")
            ph.meta[INDEX_META] = (space, level)
            placeholders.append(ph)
            inputs[name] = ph
            spaces[name] = space
        with g.inserting_before(n):
            new = g.call_function(dropout_rows, (inp, p, inputs[name], sizes[space]))
        new.meta = dict(n.meta)
        t = n.meta.get("tp")
        if t is not None and t.dtype:
            # it saves a bool mask of its rows (one byte per entry), where the dropout saved one in its dtype
            new.meta["tp"] = dataclasses.replace(t, saved_bytes=t.saved_bytes * (1.0 / _elsize(t.dtype)))
            if space != "nnz":
                _mark_replays(g, n, new, inp)
        if n.name in depths:  # (a dropout of this one's output reads it at the same depth)
            depths[new.name] = depths[n.name]
        n.replace_all_uses_with(new)
        g.erase_node(n)
    tp.recompile()
    unsupported = sorted(sp for sp in spaces.values() if allowed is not None and sp not in allowed)
    if unsupported:
        what = {"E": " (edge values: attention dropout)", "E+V": " (edge values and self loops: attention dropout)"}
        raise PlanningError(f"strategy {strategy!r} with these options cannot replicate the dropout masks of "
                            f"{unsupported[0]}-space values{what.get(unsupported[0], '')}; pass dropout='local' (each "
                            "rank draws its own masks) or remove that dropout")
    return tp


def dropout_draws(staged: StagedModel, spaces: dict[str, str], infos: dict[str, Any]
                  ) -> tuple[tuple[int, int, tuple[int, ...], str, float], ...]:
    """Every replicated dropout of the training model in single-device order, as
    ``(stage, ordinal in stage, full shape, dtype, p)`` (``RankProgram.dropout_draws``); dropouts
    inside recomputed segments included (a replay in backward looks its mask up again at the same
    position, :class:`~gnncompile.passes.recompute.Recompute`). ``infos``: value name ->
    ``TPInfo`` of the model before recomputation (segment bodies carry none)."""
    out = []
    ordinal: dict[int, int] = {}
    modules = dict(staged.tp.named_modules())

    def visit(nodes: Any, stage_of: Any) -> None:
        for n in nodes:
            if n.op == "call_module" and isinstance(modules.get(n.target), Recompute):
                visit(modules[n.target].body.graph.nodes, lambda _: stage_of(n))
                continue
            if n.op != "call_function" or n.target is not dropout_rows:
                continue
            args = call_arguments(n)
            p = float(args["p"])
            if p in (0.0, 1.0):
                continue  # draws nothing
            s = stage_of(n)
            k = ordinal.get(s, 0)
            ordinal[s] = k + 1
            x = args["x"]
            t = x.meta["tp"] if "tp" in x.meta else infos[x.name]
            index = args["index"]
            # a sparse input's mask is over its stored values (``nnz`` space): one draw per value
            per_row = () if spaces.get(getattr(index, "name", ""), "") == "nnz" else tuple(t.dims)
            out.append((s, k, (int(args["num_rows"]),) + per_row, t.dtype or "float32", p))

    visit(staged.tp.graph.nodes, lambda n: staged.stage_of[n.name])
    return tuple(out)
