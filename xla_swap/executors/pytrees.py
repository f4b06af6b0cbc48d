"""Pytree helpers shared by the executors (and the torch side's input checks): avals and shape signatures,
dtype checks of inputs and carries, stage-function lists, memory-kind checks, and the split of a pytree into
differentiable and constant leaves.

Imports numpy and jax only (and the framework-neutral memory-kind names of
``xla_swap.planning.policy``, the one place they are defined).
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from xla_swap.planning.policy import MEMORY_KINDS

#: The two memory kinds the runtimes use, as JAX / PJRT name them.
DEVICE_KIND, HOST_KIND = MEMORY_KINDS


def tree_nbytes(tree) -> int:
    """Total size in bytes of the array leaves of ``tree`` (logical, unsharded sizes).

    Args:
      tree: a pytree whose leaves have ``shape`` and ``dtype`` (numpy or jax arrays,
        ``jax.ShapeDtypeStruct``); ``None`` leaves are skipped.

    Returns:
      int, bytes: ``sum(prod(leaf.shape) * leaf.dtype.itemsize)``.
    """
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


def leaf_name(path) -> str:
    """The name of a pytree leaf at ``path`` (``jax.tree_util.keystr``; ``"<root>"`` for the root)."""
    return jax.tree_util.keystr(path) or "<root>"


def as_aval(x, what: str) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype as a ``jax.ShapeDtypeStruct``.

    Raises: TypeError naming ``what``: ``x`` is not an array or its dtype is not numpy's; ValueError:
    ``x`` is a deleted (donated or freed) jax array.
    """
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{what}: expected an array (numpy or jax), got {type(x).__name__}")
    if isinstance(x, jax.Array) and x.is_deleted():
        raise ValueError(f"{what}: the jax array has been deleted (donated or freed)")
    try:
        dtype = np.dtype(x.dtype)
    except TypeError:   # e.g. a torch tensor: its dtype is no numpy dtype
        raise TypeError(f"{what}: expected an array (numpy or jax), got {type(x).__module__}.{type(x).__name__} "
                        f"of dtype {x.dtype}") from None
    return jax.ShapeDtypeStruct(tuple(x.shape), dtype)


def tree_aval(tree, what: str):
    """Pytree of ``ShapeDtypeStruct`` for a pytree of arrays (one array is a pytree too).

    Raises:
      TypeError: a leaf is not an array, or the pytree has no leaves (the message names ``what``
        and the leaf path).
      ValueError: a leaf is a deleted jax array.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not leaves:
        raise TypeError(f"{what}: expected an array or a pytree of arrays, got {tree!r} (no array leaves)")
    return jax.tree_util.tree_unflatten(
        treedef, [as_aval(leaf, what + jax.tree_util.keystr(path)) for path, leaf in leaves])


def check_input_dtypes(tree, what: str) -> None:
    """Refuse leaves of ``tree`` that jax would silently compute in another dtype.

    With ``jax_enable_x64`` off, jax narrows 64-bit arrays to 32 bits: ``float64`` and
    ``complex128`` lose precision, so they are refused. A 64-bit integer numpy array whose
    values all fit the 32-bit type is narrowed exactly (token ids) and accepted.

    Raises:
      TypeError: a leaf of such a dtype (the message names ``what`` and the leaf path, the
        dtype got and the one jax would use).
    """
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dt = np.dtype(x.dtype)
        canon = np.dtype(jax.dtypes.canonicalize_dtype(dt))
        if canon == dt:
            continue
        name = what + jax.tree_util.keystr(path)
        if dt.kind in "iu" and isinstance(x, np.ndarray):
            info = np.iinfo(canon)
            if x.size == 0 or (int(x.min()) >= info.min and int(x.max()) <= info.max):
                continue
            raise TypeError(f"{name}: dtype {dt} holds values outside {canon}, the dtype jax computes it in "
                            f"(jax_enable_x64 is off); enable x64 (jax.config.update('jax_enable_x64', True)) "
                            f"to pass them")
        raise TypeError(f"{name}: got dtype {dt}, which jax would compute as {canon} (jax_enable_x64 is off); "
                        f"pass {canon}, or enable x64 (jax.config.update('jax_enable_x64', True))")


def check_carry_dtypes(fns: list, param_avals: list, i: int, hin, hout, what: str) -> None:
    """Stage ``i`` of a stack whose next stage runs the same ``stage_fn`` on parameters of the same
    signature must return the carry in the dtypes it got: otherwise jax promoted the input (an
    ``int32`` or ``float16`` ``h`` through ``float32`` layers) and the stack would compute in
    another dtype than the one given.

    Args: ``fns`` / ``param_avals``: per stage, the function and its parameters (arrays or avals);
      ``hin`` / ``hout``: stage ``i``'s input and output (pytrees of avals); ``what``: the name of
      the stack's input in messages.

    Raises: TypeError naming ``what`` (the leaf path), the dtype got and the one the stage computes in.
    """
    if i + 1 >= len(fns) or fns[i] is not fns[i + 1] or aval_key(param_avals[i]) != aval_key(param_avals[i + 1]):
        return
    lin, tin = jax.tree_util.tree_flatten_with_path(hin)
    lout, tout = jax.tree_util.tree_flatten(hout)
    if tin != tout:
        return
    for (path, x), y in zip(lin, lout):
        got, comp = np.dtype(x.dtype), np.dtype(y.dtype)
        if got != comp:
            src = "" if i == 0 else f" (from stage {i - 1})"
            raise TypeError(
                f"{what}{jax.tree_util.keystr(path)}: stage {i} gets dtype {got}{src} and returns {comp}, and "
                f"stage {i + 1} runs the same stage_fn: the stages would compute in {comp}, not in the {got} "
                f"given; pass {comp}")


def aval_key(tree) -> tuple:
    """Hashable (tree structure, leaf shapes and dtypes) of a pytree of avals."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(a.shape), str(np.dtype(a.dtype))) for a in leaves)


def describe(tree) -> str:
    """A pytree of arrays in words for error messages: ``"shape (2, 3) dtype float32"`` for one array,
    else its tree structure and each leaf's dtype and shape."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef == jax.tree_util.tree_structure(0):
        return f"shape {tuple(leaves[0].shape)} dtype {np.dtype(leaves[0].dtype)}"
    return f"{treedef} with leaves " + ", ".join(f"{np.dtype(a.dtype)}{list(a.shape)}" for a in leaves)


def stage_fns(stage_fn, n: int) -> tuple[list, bool]:
    """``stage_fn`` (one callable or one per stage) -> (list of n callables, shared?).

    Raises:
      TypeError: not a callable or a sequence of callables (an element is named).
      ValueError: a sequence whose length is not ``n``.
    """
    if callable(stage_fn):
        return [stage_fn] * n, True
    if isinstance(stage_fn, Sequence) and not isinstance(stage_fn, (str, bytes)):
        fns = list(stage_fn)
        if len(fns) != n:
            raise ValueError(f"stage_fn has {len(fns)} functions but stage_params has {n} stages")
        for i, f in enumerate(fns):
            if not callable(f):
                raise TypeError(f"stage_fn[{i}] is not callable: {type(f).__name__}")
        return fns, False
    raise TypeError(f"stage_fn must be a callable or a sequence of callables, got {type(stage_fn).__name__}")


def wrap(f):
    """A new function object calling ``f`` (``functools.wraps``): its own identity for jax's caches."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)
    return wrapper


def own_fns(fns: list) -> list:
    """Per-runtime wrappers of ``fns`` (one per distinct object; shared objects stay shared).

    jax's tracing caches hold their entries as long as the traced function object is alive
    (weak key) and key each ``jax.jit`` instance by identity, so tracing a long-lived user
    function from every new runtime adds entries that outlive the runtime. A runtime traces
    and compiles only these wrappers: they die with the runtime, and jax drops their entries.
    """
    out, made = [], {}
    for f in fns:
        w = made.get(id(f))
        if w is None:
            w = made[id(f)] = wrap(f)
        out.append(w)
    return out


def check_memory_kinds(dev, who: str) -> None:
    """Raise ``ValueError`` unless ``dev`` has the ``pinned_host`` and ``device`` memory kinds."""
    kinds = {m.kind for m in dev.addressable_memories()}
    if HOST_KIND not in kinds or DEVICE_KIND not in kinds:
        raise ValueError(f"device {dev} has memory kinds {sorted(kinds)}; {who} needs {HOST_KIND!r} and "
                         f"{DEVICE_KIND!r}")


def param_key(params, shardings) -> tuple:
    """A hashable key of a stage's weights as placed: their tree structure, and per leaf its shape, dtype
    and sharding (``params`` and ``shardings`` pytrees of one structure; arrays or avals)."""
    return (jax.tree_util.tree_structure(params),
            tuple((tuple(a.shape), str(a.dtype), s) for a, s in zip(jax.tree_util.tree_leaves(params),
                                                                    jax.tree_util.tree_leaves(shardings))))


def index_by_identity(items, x):
    """The index of the first element of ``items`` that *is* ``x`` (not ``==``), or ``None``."""
    for j, item in enumerate(items):
        if item is x:
            return j
    return None


def probe(a, seed: int = 0) -> np.ndarray:
    """A numpy array of aval ``a`` to time a stage with: N(0, 1) values for a floating dtype, zeros
    otherwise (indices, masks). Not zeros throughout: a GPU's matmul units draw less power on
    zeros, so an all-zero input can time faster than the data the runtime then runs on
    (docs/explanation/history.md, "Stage timing inputs")."""
    dt = np.dtype(a.dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        return np.zeros(a.shape, dt)
    return np.random.default_rng(seed).standard_normal(a.shape, dtype=np.float32).astype(dt)


def is_diff(a) -> bool:
    """True for leaves that get gradients: floating or complex dtypes."""
    return bool(jnp.issubdtype(a.dtype, jnp.inexact))


def split_diff(tree):
    """Split a pytree into its differentiable leaves and its constant (integer/bool) leaves.

    Returns:
      ``(diff, const, spec)``: two lists of leaves and the ``spec`` that ``merge_diff``
      needs to rebuild the tree.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mask = tuple(is_diff(x) for x in leaves)
    return ([x for x, m in zip(leaves, mask) if m], [x for x, m in zip(leaves, mask) if not m], (treedef, mask))


def merge_diff(diff, const, spec):
    """Inverse of ``split_diff``; ``const`` may be ``None`` (those leaves become ``None``)."""
    treedef, mask = spec
    di, ci = iter(diff), iter(const if const is not None else [None] * (len(mask) - sum(mask)))
    return jax.tree_util.tree_unflatten(treedef, [next(di) if m else next(ci) for m in mask])
