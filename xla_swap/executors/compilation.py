"""Compilation of a streaming runtime's stage executables, and their caches.

Per input signature (structure, shapes and dtypes of ``h``) a :class:`Signature` holds the
avals of every stage's input and the executables compiled for it: one per distinct (stage
function, parameter signature, input signature, kind), shared by stages that agree on all of
them. Kinds: ``forward``, ``forward-save`` (output and saved residuals), ``backward`` (vjp by
recomputing the forward), ``backward-saved`` (vjp from saved residuals), with the optimizer
update fused in or the gradients accumulated. The signatures are a bounded LRU cache
(``max_signatures``), and so are the jitted loss functions (:data:`MAX_LOSS_FNS`) and the
update pass's executables. Imports only jax (no torch).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from xla_swap.planning.cache import LRUCache
from xla_swap.planning.optimizer import HYPER_WIDTH

from ._stages import (aval_key, check_carry_dtypes, check_input_dtypes, describe, merge_diff, own_fns,
                      split_diff, tree_aval)
from .stage_programs import (forward_save_fn, gathered, recompute_vjp, saved_vjp, with_accum, with_update,
                             without_gathered)

__all__ = ["DEFAULT_MAX_SIGNATURES", "MAX_LOSS_FNS", "Signature", "RuntimeCompilation"]

#: Default bound of the per-input-signature executable cache (``max_signatures``).
DEFAULT_MAX_SIGNATURES = 8
#: Bound of the cache of jitted loss functions (one per distinct ``loss_fn`` object).
MAX_LOSS_FNS = 8


@dataclasses.dataclass
class Signature:
    """Everything compiled for one input signature (tree structure, shapes and dtypes of ``h``)."""

    in_aval: Any
    chain: list  # avals (pytrees) of the input of stage i, i = 0..n (chain[n] is the output)
    stage_exe: dict = dataclasses.field(default_factory=dict)  # (kind, stage) -> compiled
    compiled: dict = dataclasses.field(default_factory=dict)   # dedupe key -> compiled
    saved_layout: dict = dataclasses.field(default_factory=dict)  # dedupe base -> (vjp treedef, sources)
    residual_nbytes: list | None = None
    #: with ``batch_axis``: the batch does not split over the devices, so every activation is
    #: replicated and each stage gathers its weights (``RuntimePlacement.runs_replicated``).
    replicated: bool = False
    warned: bool = False   # the warning of a replicated signature was given


class RuntimeCompilation:
    """The compilation part of :class:`xla_swap.executors.StreamingRuntime` (a base class of it,
    not used alone): the signature cache, the stage, loss and update executables."""

    def _init_caches(self) -> None:
        """Empty caches: signatures (with their executables), loss functions, update executables."""
        self._sigs = LRUCache(self.max_signatures)  # input key -> Signature
        self._last_sig: Signature | None = None
        self._loss_jits = LRUCache(MAX_LOSS_FNS)  # loss_fn -> its jitted value and gradient
        self._loss_shapes: dict = {}
        # parameter signature -> the update pass's executable (two per distinct stage at most: donating or not)
        self._update_exes = LRUCache(2 * self.num_stages)

    @property
    def num_executables(self) -> int:
        """Number of distinct stage executables compiled and cached now (forward and backward, all signatures)."""
        return sum(len(s.compiled) for s in self._sigs.values())

    @property
    def num_signatures(self) -> int:
        """Number of input signatures whose executables are cached (at most ``max_signatures``)."""
        return len(self._sigs)

    def clear_executables(self) -> None:
        """Drop every compiled executable and traced loss function; the next call traces and compiles again.

        For a change of a setting read at trace time (``jax.default_matmul_precision``, say)
        that the executables' cache keys do not hold. Weights, optimizer state and the
        weights prefetched for the next call are kept.
        """
        self._sigs.clear()
        self._last_sig = None
        self._loss_jits.clear()
        self._loss_shapes.clear()
        self._update_exes.clear()

    #: the kinds of stage executable :meth:`stage_executable` compiles.
    STAGE_KINDS = ("forward", "forward-save", "backward", "backward-saved")

    @property
    def stage_fns(self) -> tuple:
        """The caller's stage functions, one per stage (the same object repeated for a shared one)."""
        return tuple(self._fns)

    @property
    def stage_fn_ids(self) -> tuple:
        """Per stage, the index of its function among the distinct stage functions (by identity):
        stages of equal index, parameter avals and input avals share their executables."""
        return tuple(self._fn_ids)

    def signature(self, h, what: str = "h") -> Signature:
        """The :class:`Signature` of input ``h``: per stage the avals of its input (``chain``), traced
        on first use and cached with its executables (at most ``max_signatures``).

        Args:
          h: an input of ``forward`` (array or pytree of arrays).
          what: how error messages name ``h``.

        Raises: as ``forward`` for a bad ``h`` (nothing changes then).
        """
        return self._signature(h, what)

    def stage_executable(self, sig: Signature, kind: str, stage: int):
        """Stage ``stage``'s compiled executable of ``kind`` for input signature ``sig``, as ``train_step``
        or ``forward`` runs it but donating nothing (cached; compiled on first use).

        Args:
          sig: from :meth:`signature`.
          kind: one of :attr:`STAGE_KINDS`: ``forward`` ``(p, x) -> y``; ``forward-save``
            ``(p, x) -> (y, saved)``; ``backward`` ``(p, x, g, [state, hyper]) -> ...`` (recomputes the
            forward); ``backward-saved`` ``(p, x, saved, g, [state, hyper]) -> ...``. With an optimizer
            a backward returns ``(gx, new_params, new_state)``, else ``(gx, grads)`` (``grads``: a list, the
            gradients of the stage's trainable leaves in leaf order: ``trainable_mask``).
          stage: the stage index.

        Returns: a ``jax.stages.Compiled``.

        Raises: TypeError: ``sig`` is not a :class:`Signature`; ValueError: ``kind`` not one of
          :attr:`STAGE_KINDS`, ``stage`` not an int in ``[0, num_stages)``.
        """
        if not isinstance(sig, Signature):
            raise TypeError(f"sig must be a Signature (from StreamingRuntime.signature), got {type(sig).__name__}")
        if kind not in self.STAGE_KINDS:
            raise ValueError(f"kind must be one of {self.STAGE_KINDS}, got {kind!r}")
        self._check_stage(stage)
        return self._exe(sig, kind, stage, False)

    def _signature(self, h, what: str = "h") -> Signature:
        """The cached signature of ``h`` (LRU), or a new one traced stage by stage (no state change on error).

        ``what`` names ``h`` in error messages (``SwappedStack`` passes ``"inputs"``).
        """
        a = tree_aval(h, what)
        check_input_dtypes(h, what)
        key = aval_key(a)
        sig = self._sigs.get(key)
        if sig is not None:
            self._last_sig = sig
            return sig
        chain = [a]
        for i, (f, pav) in enumerate(zip(self._traced_fns, self._param_avals)):
            try:
                out = jax.eval_shape(f, pav, chain[-1])
            except Exception as e:  # noqa: BLE001 - re-raised with the stage named
                raise ValueError(f"stage {i}: stage_fn(params, h) failed to trace for h of {describe(chain[-1])}: "
                                 f"{type(e).__name__}: {e}") from e
            leaves = jax.tree_util.tree_leaves(out)
            if not leaves or not all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
                raise TypeError(f"stage {i}: stage_fn must return an array or a pytree of arrays, "
                                f"got {jax.tree_util.tree_structure(out)}")
            chain.append(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out))
            check_carry_dtypes(self._fns, self._param_avals, i, chain[-2], chain[-1], what)
        sig = Signature(a, chain, replicated=self.runs_replicated(a))
        self._sigs.put(key, sig)
        self._last_sig = sig
        return sig

    def _warn_replicated(self, sig: Signature) -> None:
        """Warn once per signature, at its first run, that it runs replicated (``runs_replicated``)."""
        if sig.replicated and not sig.warned:
            sig.warned = True
            lead = jax.tree_util.tree_leaves(sig.in_aval)[0].shape[:1]
            warnings.warn(f"the input's leading dimension {lead} (its first leaf's) does not split over the "
                          f"{self._gathered_sharding(True).mesh.size} devices of batch_axis {self.batch_axis!r}: it "
                          "runs replicated (every device computes the whole batch, each stage's weights gathered). "
                          "Exact, but without data parallelism: give a batch that is a multiple of the device "
                          "count to split it", stacklevel=4)

    def _spec(self, aval, sharding):
        """``ShapeDtypeStruct`` (pytree) of ``aval`` with ``sharding`` (one, or a pytree like ``aval``) on its leaves."""
        if isinstance(sharding, Sharding):
            return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), aval)
        return jax.tree_util.tree_map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), aval, sharding)


    def _exe(self, sig: Signature, kind: str, i: int, donate: bool, mode: str | None = None, acc: bool = False):
        """Stage ``i``'s executable of ``kind`` (``forward``, ``forward-save``, ``backward``,
        ``backward-saved``); for a backward, ``mode`` is ``None`` (gradients out), ``"update"``
        (the optimizer fused in) or ``"accum"`` (gradients summed into the accumulator, and their
        sum of squares), and ``acc`` whether it takes the accumulated gradients."""
        if mode is None and self.optimizer is not None and kind.startswith("backward"):
            mode = "update"
        kind = kind + ("-accum" if mode == "accum" else "") + ("+acc" if acc else "")
        key_stage = (kind + ("-donate" if donate else ""), i)
        exe = sig.stage_exe.get(key_stage)
        if exe is not None:
            return exe
        f = gathered(self._traced_fns[i], self._gathered_sharding(sig.replicated))
        pkey = (jax.tree_util.tree_structure(self._param_avals[i]),
                tuple((a.shape, str(a.dtype), s) for a, s in zip(jax.tree_util.tree_leaves(self._param_avals[i]),
                                                                   jax.tree_util.tree_leaves(self._dev_sh[i]))),
                tuple(self._train_mask[i]), self.group_idx[i])
        hin, hout = sig.chain[i], sig.chain[i + 1]
        base = (self._fn_ids[i], pkey, aval_key(hin), aval_key(hout))
        key = (base[0], key_stage[0]) + base[1:]
        exe = sig.compiled.get(key)
        if exe is None:
            act = self.activation_sharding
            pspec = jax.tree_util.tree_map(self._spec, self._param_avals[i], self._dev_sh[i])
            act_of = functools.partial(self._act, replicated=sig.replicated)
            hspec = self._spec(hin, act_of(hin))
            gout = split_diff(hout)[0]
            gspec = self._spec(gout, act_of(gout))
            gin_sh = act_of(split_diff(hin)[0])  # the input cotangent's
            # the output cotangent may reuse the input cotangent's buffer (same avals)
            same = aval_key(split_diff(hin)[0]) == aval_key(split_diff(hout)[0])
            opt = self.optimizer
            if kind == "forward":
                exe = jax.jit(f, out_shardings=act_of(hout)).lower(pspec, hspec).compile()
            elif kind == "forward-save":
                exe = self._compile_forward_save(sig, i, f, base, pspec, hspec, act_of(hout))
            else:
                saved = kind.startswith("backward-saved")
                if saved:
                    fwd_save = self._exe(sig, "forward-save", i, False)
                    core = saved_vjp(*sig.saved_layout[base])
                    sspec = jax.tree_util.tree_map(
                        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        fwd_save.out_info[1], fwd_save.output_shardings[1])
                    specs = (pspec, hspec, sspec, gspec)
                else:
                    core = recompute_vjp(f, self._train_mask[i])
                    specs = (pspec, hspec, gspec)
                g_arg = len(specs) - 1
                if opt is None:
                    fn = core
                    donate_argnums = ((0, g_arg) if same else (0,)) if donate else ()
                    out_sh = (gin_sh, self._grad_dev_sh[i])
                else:
                    base_donate = ((0, g_arg) if same else (0,))
                    if acc:
                        sel = [j for j, m in enumerate(self._train_mask[i]) if m]
                        leaves = jax.tree_util.tree_leaves(self._param_avals[i])
                        specs = specs + ([jax.ShapeDtypeStruct(leaves[j].shape, leaves[j].dtype, sharding=sh)
                                          for j, sh in zip(sel, self._acc_dev_sh[i])],)
                        if mode == "accum":  # the sum reuses the accumulator's buffer (not the weights')
                            base_donate = tuple(a for a in base_donate if a != 0) + (len(specs) - 1,)
                    if mode == "accum":
                        fn = with_accum(core, acc)
                        out_sh = (gin_sh, self._acc_dev_sh[i], act)
                    else:
                        fn = with_update(core, self._train_mask[i], self.group_idx[i], acc)
                        st_spec = jax.tree_util.tree_map(
                            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            self.optimizer_state[i], self._state_dev_sh[i])
                        specs = specs + (st_spec, jax.ShapeDtypeStruct((len(self._groups0), HYPER_WIDTH), np.float32,
                                                                       sharding=act))
                        base_donate += (len(specs) - 2,)
                        out_sh = (gin_sh, self._dev_sh[i], self._state_dev_sh[i])
                    donate_argnums = base_donate if donate else ()
                exe = jax.jit(fn, out_shardings=out_sh, donate_argnums=donate_argnums).lower(*specs).compile()
            sig.compiled[key] = exe
        sig.stage_exe[key_stage] = exe
        return exe

    def _compile_forward_save(self, sig, i: int, f, base, pspec, hspec, out_sh):
        """Compile stage ``i``'s ``(p, x) -> (y, saved)`` (``f`` its function as traced): its output and its vjp residuals (w.r.t. its
        trainable leaves and the floating leaves of ``x``) minus ``p`` and ``x``.

        ``jax.vjp`` returns its residuals as the leaves of the vjp function (a pytree); while
        tracing, residuals that *are* the traced weights or stage input (identity) are
        recorded as such in ``sig.saved_layout[base]`` and not returned, so the weights
        are not kept on the device between the passes.
        """
        layout_out = {}
        remat = without_gathered(self.remat) if sig.replicated else self.remat
        fwd_save = forward_save_fn(f, remat, layout_out, self._train_mask[i])
        try:
            exe = jax.jit(fwd_save, out_shardings=(out_sh, None)).lower(pspec, hspec).compile()
        except ValueError as e:
            # The partitioner may pick a residual sharding that jax cannot express over the mesh
            # (IndivisibleError, seen for a [1, 4, 1, 2] attention residual over 8 devices): keep
            # those residuals in the activation sharding instead.
            if "divisible" not in str(e):
                raise
            exe = jax.jit(fwd_save, out_shardings=(out_sh, self.activation_sharding)
                          ).lower(pspec, hspec).compile()
        sig.saved_layout[base] = layout_out["layout"]
        return exe

    def _loss_exe(self, loss_fn, out_aval, loss_args):
        args_aval = tuple(tree_aval(a, f"loss_args[{j}]") for j, a in enumerate(loss_args))
        skey = (loss_fn, aval_key(out_aval), tuple(aval_key(a) for a in args_aval))
        try:
            known = self._loss_shapes.get(skey)
        except TypeError:  # an unhashable loss_fn
            known, skey = None, None
        if not known:
            try:
                val = jax.eval_shape(own_fns([loss_fn])[0], out_aval, *args_aval)  # see own_fns
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"loss_fn(out, *loss_args) failed to trace for out of {describe(out_aval)}: "
                                 f"{type(e).__name__}: {e}") from e
            if not isinstance(val, jax.ShapeDtypeStruct) or val.shape != () or \
                    not jnp.issubdtype(val.dtype, jnp.inexact):
                raise ValueError(f"loss_fn must return a floating scalar (shape ()), got {val}")
            if skey is not None:
                if len(self._loss_shapes) >= 4 * MAX_LOSS_FNS:
                    self._loss_shapes.clear()
                self._loss_shapes[skey] = True
        jitted = self._loss_jits.get(loss_fn) if skey is not None else None
        if jitted is None:
            def value_and_grad(out, *args, loss_fn=loss_fn):
                od, oc, os_ = split_diff(out)
                return jax.value_and_grad(lambda od: loss_fn(merge_diff(od, oc, os_), *args))(od)

            # with batch_axis the gradient keeps the output's sharding (placed by the caller)
            grad_sharding = self.activation_sharding if self._batch_sh is None else None
            jitted = jax.jit(value_and_grad, out_shardings=(None, grad_sharding))
            if skey is not None:
                for evicted, _ in self._loss_jits.put(loss_fn, jitted):
                    self._loss_shapes = {k: v for k, v in self._loss_shapes.items() if k[0] is not evicted}
                    if not getattr(self, "_warned_loss", False):
                        self._warned_loss = True
                        warnings.warn("StreamingRuntime.train_step: more than "
                                      f"{MAX_LOSS_FNS} distinct loss_fn objects; each new one compiles again. "
                                      "Pass per-step data through loss_args instead of a new closure.",
                                      stacklevel=4)
        return jitted

    def _train_loss_exe(self, h, loss_fn, cotangent, loss_args):
        """Check ``train_step``'s input, cotangent and loss arguments against ``h``'s signature (traced
        and cached here); returns the jitted loss (``None`` with a ``cotangent``).

        Raises: as ``train_step`` for its input, ``cotangent`` and ``loss_fn``.
        """
        if cotangent is not None:   # checked before h's signature is traced and cached
            tree_aval(cotangent, "cotangent")
            check_input_dtypes(cotangent, "cotangent")
        for j, a in enumerate(loss_args):
            tree_aval(a, f"loss_args[{j}]")
            check_input_dtypes(a, f"loss_args[{j}]")
        sig = self._signature(h)
        if not any(split_diff(a)[0] for a in self._param_avals):
            raise TypeError("train_step: no stage has a floating parameter; nothing to differentiate")
        out_aval = sig.chain[-1]
        out_diff = split_diff(out_aval)[0]
        if not out_diff:
            raise TypeError(f"train_step: the output ({describe(out_aval)}) has no floating leaf; "
                            "gradients need a floating output")
        if cotangent is None:
            return self._loss_exe(loss_fn, out_aval, loss_args)
        given = tree_aval(cotangent, "cotangent")
        if aval_key(given) != aval_key(out_diff) and aval_key(given) != aval_key(out_aval):
            raise ValueError(f"cotangent has {describe(given)}, but the output has {describe(out_aval)}")
        return None
