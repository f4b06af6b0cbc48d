"""The jax functions a stage's executables trace: its forward with saved residuals, its vjp
(recomputing the forward, or from saved residuals) and the optimizer update fused after it.

Each builder takes the stage function (or a vjp ``core``) and returns a function of arrays for
``jax.jit``; the runtime's compilation (``xla_swap.executors.streaming.compilation``) lowers them with
shardings. Every vjp is taken w.r.t. the stage input's floating leaves and the weights the runtime's
``train_mask`` marks trainable; the other weights (frozen, e.g. a LoRA model's base) are constants of
it: their gradients are never computed, and an update returns them as they came in. Imports only
jax (no torch).
"""
from __future__ import annotations

import jax

from .. import optim as _optim
from ..pytrees import index_by_identity, merge_diff, split_diff

__all__ = ["gathered", "without_gathered", "trainable_split", "forward_save_fn", "recompute_vjp", "saved_vjp",
           "trainable_grads", "with_accum", "update_only", "with_update"]


def gathered(f, sharding):
    """``(p, *args) -> f(p, *args)`` with the weights ``p`` constrained to ``sharding`` first (``None``: ``f``).

    A stage whose activations are replicated over a mesh (a batch that does not split over the data-parallel
    devices) gathers its sharded weights so: every operand is then replicated and XLA's partitioner keeps the
    whole computation replicated, as on one device, instead of splitting it along a weight's sharded
    dimension (which a custom partitioner such as cuDNN attention's refuses for a sequence or head
    dimension). The gradient of ``p`` is reduced back to ``p``'s own sharding by the executable's outputs.
    """
    if sharding is None:
        return f

    def g(p, *args):
        return f(jax.lax.with_sharding_constraint(p, sharding), *args)
    return g


def without_gathered(remat):
    """The ``remat`` of :func:`forward_save_fn` for a :func:`gathered` stage: ``False`` or a policy, less the
    gathered weights (outputs of ``sharding_constraint``): they are gathered again in the backward from the
    weights themselves, which are not saved, instead of being kept on the device between the passes."""
    def policy(prim, *args, **params):
        return prim.name != "sharding_constraint" and (remat is False or remat(prim, *args, **params))
    return policy


def trainable_split(p, train_mask: list) -> tuple:
    """``(trainable, rebuild)``: the leaves of ``p`` that ``train_mask`` marks (in leaf order), and
    ``rebuild(new) -> p`` with those leaves replaced by ``new``: the other leaves (frozen weights,
    buffers, integers) enter a vjp as constants, so no gradient of theirs is ever computed."""
    leaves, treedef = jax.tree_util.tree_flatten(p)
    sel = [j for j, m in enumerate(train_mask) if m]

    def rebuild(new):
        out = list(leaves)
        for j, v in zip(sel, new):
            out[j] = v
        return jax.tree_util.tree_unflatten(treedef, out)
    return [leaves[j] for j in sel], rebuild


def forward_save_fn(f, remat, layout_out: dict, train_mask: list):
    """``(p, x) -> (y, saved)``: a stage's output and its vjp residuals minus ``p`` and ``x``.

    The vjp is taken w.r.t. the leaves of ``p`` that ``train_mask`` marks and the floating leaves
    of ``x`` (the others are constants: their gradients are neither computed nor kept for).
    ``jax.vjp`` returns its residuals as the leaves of the vjp function (a pytree); while
    tracing, residuals that *are* the traced weights or stage input (identity) are recorded as
    such in ``layout_out["layout"] = (vjp treedef, sources)`` and not returned, so the weights are not
    kept on the device between the passes. ``remat``: ``False`` keeps every residual, a
    ``jax.checkpoint_policies`` policy those ``jax.checkpoint`` saves.
    """
    fs = f if remat is False else jax.checkpoint(f, policy=remat)

    def fwd_save(p, x):
        pt, rebuild = trainable_split(p, train_mask)
        xd, xc, xs = split_diff(x)

        def on_floating(pt, xd):
            yd, yc, ys = split_diff(fs(rebuild(pt), merge_diff(xd, xc, xs)))
            return yd, (yc, ys)

        yd, vjp, (yc, ys) = jax.vjp(on_floating, pt, xd, has_aux=True)
        res, treedef = jax.tree_util.tree_flatten(vjp)
        pl, xl = jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(x)
        sources, saved = [], []
        for r in res:
            j = index_by_identity(pl, r)
            if j is not None:
                sources.append(("p", j))
                continue
            j = index_by_identity(xl, r)
            if j is not None:
                sources.append(("x", j))
                continue
            sources.append(("s", len(saved)))
            saved.append(r)
        layout_out["layout"] = (treedef, tuple(sources))
        return merge_diff(yd, yc, ys), saved
    return fwd_save


def recompute_vjp(f, train_mask: list):
    """``(p, x, g) -> (gx, gp)``: the stage's vjp by recomputing its forward, w.r.t. the floating leaves
    of ``x`` and the leaves of ``p`` that ``train_mask`` marks (``gp``: their gradients, in leaf order)."""
    def core(p, x, g):
        pt, rebuild = trainable_split(p, train_mask)
        xd, xc, xs = split_diff(x)

        def on_floating(pt, xd):
            return split_diff(f(rebuild(pt), merge_diff(xd, xc, xs)))[0]

        _, vjp = jax.vjp(on_floating, pt, xd)
        gp, gx = vjp(g)
        return gx, gp
    return core


def saved_vjp(treedef, sources):
    """``(p, x, saved, g) -> (gx, gp)``: the stage's vjp rebuilt from the forward's residuals (``gp``: the
    gradients of the leaves the forward's ``train_mask`` marked)."""
    def core(p, x, saved, g):
        src = {"p": jax.tree_util.tree_leaves(p), "x": jax.tree_util.tree_leaves(x), "s": saved}
        vjp = jax.tree_util.tree_unflatten(treedef, [src[kind][j] for kind, j in sources])
        gp, gx = vjp(g)
        return gx, gp
    return core


def trainable_grads(gp, acc) -> list:
    """The gradients ``gp`` of the trainable leaves (a vjp ``core``'s), plus ``acc`` when given."""
    grads = list(gp)
    if acc is not None:
        grads = [a + g for a, g in zip(acc, grads)]
    return grads


def with_accum(core, has_acc: bool):
    """Wrap a vjp ``core``: ``(..., [acc]) -> (gx, acc + grads of the trainable leaves, their sum of squares)``."""
    def fn(*args):
        core_args, acc = (args[:-1], args[-1]) if has_acc else (args, None)
        gx, gp = core(*core_args)
        grads = trainable_grads(gp, acc)
        return gx, grads, _optim.sum_squares(grads)
    return fn


def update_only(train_mask: list, groups: tuple):
    """``(p, grads, state, hyper, coef) -> (new_p, new_state)``: AdamW on the trainable leaves with ``grads * coef``
    (``new_p``: ``p`` with those leaves replaced; the others are ``p``'s own, aliased where ``p`` is donated)."""
    def fn(p, grads, state, hyper, coef):
        pt, rebuild = trainable_split(p, train_mask)
        new_sel, new_state = _optim.apply_update(pt, grads, state, hyper, list(groups), scale=coef)
        return rebuild(new_sel), new_state
    return fn


def with_update(core, train_mask: list, groups: tuple, has_acc: bool = False):
    """Wrap a vjp ``core`` so that it also applies AdamW to the trainable leaves: ``(..., [acc], state, hyper) ->
    (gx, new_params, new_state)`` (``groups``: each trainable leaf's row of ``hyper``; ``acc``: gradients
    accumulated by earlier micro-batches, added first; ``new_params`` as :func:`update_only`'s)."""
    def fn(*args):
        *core_args, state, hyper = args
        acc = core_args.pop() if has_acc else None
        gx, gp = core(*core_args)
        pt, rebuild = trainable_split(core_args[0], train_mask)
        new_sel, new_state = _optim.apply_update(pt, trainable_grads(gp, acc), state, hyper, list(groups))
        return gx, rebuild(new_sel), new_state
    return fn
