"""Compilation of a streaming runtime's stage executables, and their caches.

Per input signature (structure, shapes and dtypes of ``h``) a :class:`Signature` holds the
avals of every stage's input and the executables compiled for it: one per distinct (stage
function, parameter signature, input signature, kind), shared by stages that agree on all of
them. Kinds: ``forward``, ``forward-save`` (output and saved residuals), ``backward`` (vjp by
recomputing the forward), ``backward-saved`` (vjp from saved residuals), with the optimizer
update fused in or the gradients accumulated. The signatures are a bounded LRU cache
(``max_signatures``), and so are the jitted loss functions (:data:`MAX_LOSS_FNS`) and the
update pass's executables. A :class:`StageCompiler` owns these caches; it reads the stages' layouts
from the runtime's ``StageStore`` and places activations by its ``ActivationLayout``. Imports only
jax (no torch).
"""
from __future__ import annotations

import functools
import warnings
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from xla_swap.planning.cache import LRUCache
from xla_swap.planning.optimizer import HYPER_WIDTH

from .config import DEFAULT_MAX_SIGNATURES, BackwardMode
from .signatures import ExeKey, Signature, SignatureCache, StageKey, distinct_ids
from ..pytrees import (aval_key, check_carry_dtypes, check_input_dtypes, describe, merge_diff, own_fns, split_diff,
                       tree_aval)
from .stage_programs import (forward_save_fn, gathered, recompute_vjp, saved_vjp, update_only, with_accum,
                             with_update, without_gathered)

__all__ = ["DEFAULT_MAX_SIGNATURES", "MAX_LOSS_FNS", "ExeKey", "Signature", "StageCompiler", "StageKey"]

#: Bound of the cache of jitted loss functions (one per distinct ``loss_fn`` object).
MAX_LOSS_FNS = 8


class StageCompiler:
    """The compiled side of a streaming runtime: its stage functions (the caller's and this runtime's own
    wrappers), the signature cache with the stage executables, the jitted loss functions and the update
    pass's executables.

    Args:
      fns: the caller's stage functions, one per stage.
      store: the runtime's ``StageStore`` (the stages' layouts; the optimizer state's shapes).
      layout: the runtime's ``ActivationLayout``.
      remat: the runtime's ``remat`` (``True``, ``False`` or a policy).
      max_signatures: the bound of the signature cache.
      num_groups: the optimizer's parameter groups (0 without an optimizer).
    """

    #: the kinds of stage executable :meth:`stage_executable` compiles.
    STAGE_KINDS = ("forward", "forward-save", "backward", "backward-saved")

    def __init__(self, fns: list, store, layout, *, remat, max_signatures: int, num_groups: int):
        self.fns: list = fns  # the caller's stage functions
        self.traced_fns: list = own_fns(fns)  # what this runtime traces and compiles (see own_fns)
        self.fn_ids: list[int] = distinct_ids(fns)
        self.store, self.layout, self.remat, self.num_groups = store, layout, remat, num_groups
        self.cache = SignatureCache(max_signatures)
        self.loss_jits = LRUCache(MAX_LOSS_FNS)  # loss_fn -> its jitted value and gradient
        self.loss_shapes: dict = {}
        # parameter key -> the update pass's executable (two per distinct stage at most: donating or not)
        self.update_cache = LRUCache(2 * store.num_stages)
        self._warned_loss = False

    @property
    def sigs(self):
        """The cached signatures: an ``LRUCache`` of input key -> :class:`Signature`."""
        return self.cache.sigs

    @property
    def last_sig(self) -> Signature | None:
        """The signature of the last call or lookup (``None`` before the first)."""
        return self.cache.last_sig

    @property
    def num_executables(self) -> int:
        """Number of distinct stage executables compiled and cached now (forward and backward, all signatures)."""
        return self.cache.num_executables

    @property
    def num_signatures(self) -> int:
        """Number of input signatures whose executables are cached (at most ``max_signatures``)."""
        return len(self.sigs)

    def clear_executables(self) -> None:
        """Drop every compiled executable and traced loss function; the next call traces and compiles again.

        For a change of a setting read at trace time (``jax.default_matmul_precision``, say)
        that the executables' cache keys do not hold. Weights, optimizer state and the
        weights prefetched for the next call are kept.
        """
        self.cache.clear()
        self.loss_jits.clear()
        self.loss_shapes.clear()
        self.update_cache.clear()

    @property
    def stage_fns(self) -> tuple:
        """The caller's stage functions, one per stage (the same object repeated for a shared one)."""
        return tuple(self.fns)

    @property
    def stage_fn_ids(self) -> tuple:
        """Per stage, the index of its function among the distinct stage functions (by identity):
        stages of equal index, parameter avals and input avals share their executables."""
        return tuple(self.fn_ids)

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
        self.store.check_stage(stage)
        return self.exe(sig, self.exe_key(kind), stage)

    def exe_key(self, kind: str, donate: bool = False, mode: BackwardMode | None = None,
                takes_acc: bool = False) -> ExeKey:
        """The :class:`ExeKey` of a ``kind`` executable; a backward's ``mode`` defaults to the fused update
        with an optimizer, else gradients out."""
        if not kind.startswith("backward"):
            return ExeKey(kind, donate=donate)
        if mode is None:
            mode = BackwardMode.UPDATE if self.num_groups else BackwardMode.GRADS
        return ExeKey(kind, mode, takes_acc, donate)

    def signature(self, h, what: str = "h") -> Signature:
        """The :class:`Signature` of input ``h``: per stage the avals of its input (``chain``), traced
        on first use and cached with its executables (at most ``max_signatures``, LRU).

        Args:
          h: an input of ``forward`` (array or pytree of arrays).
          what: how error messages name ``h`` (``SwappedStack`` passes ``"inputs"``).

        Raises: as ``forward`` for a bad ``h`` (nothing changes then).
        """
        a = tree_aval(h, what)
        check_input_dtypes(h, what)
        return self.cache.signature(a, lambda a: self._trace_chain(a, what), self.layout.runs_replicated)

    def _trace_chain(self, a, what: str) -> list:
        """The avals of every stage's input for an input of avals ``a`` (``chain[n]`` the output), traced
        stage by stage. Raises: ValueError naming the stage that fails to trace; TypeError for a stage
        that returns no array, or changes the carry's dtypes where the next stage shares its function."""
        chain = [a]
        avals = [lay.param_aval for lay in self.store.layouts]
        for i, (f, pav) in enumerate(zip(self.traced_fns, avals)):
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
            check_carry_dtypes(self.fns, avals, i, chain[-2], chain[-1], what)
        return chain

    def warn_replicated(self, sig: Signature) -> None:
        """Warn once per signature, at its first run, that it runs replicated (``runs_replicated``)."""
        if sig.replicated and not sig.warned:
            sig.warned = True
            lead = jax.tree_util.tree_leaves(sig.in_aval)[0].shape[:1]
            warnings.warn(f"the input's leading dimension {lead} (its first leaf's) does not split over the "
                          f"{self.layout.gathered_sharding(True).mesh.size} devices of batch_axis "
                          f"{self.layout.batch_axis!r}: it "
                          "runs replicated (every device computes the whole batch, each stage's weights gathered). "
                          "Exact, but without data parallelism: give a batch that is a multiple of the device "
                          "count to split it", stacklevel=4)

    def _spec(self, aval, sharding):
        """``ShapeDtypeStruct`` (pytree) of ``aval`` with ``sharding`` (one, or a pytree like ``aval``) on its leaves."""
        if isinstance(sharding, Sharding):
            return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), aval)
        return jax.tree_util.tree_map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), aval, sharding)

    def exe(self, sig: Signature, key: ExeKey, i: int):
        """Stage ``i``'s executable ``key`` for signature ``sig`` (cached per stage, and shared by the
        stages of equal :class:`StageKey`)."""
        def base_of() -> StageKey:
            return StageKey(self.fn_ids[i], self.store.layouts[i].param_key(), aval_key(sig.chain[i]),
                            aval_key(sig.chain[i + 1]))
        return self.cache.executable(sig, i, key, base_of, lambda base: self._compile(sig, key, i, base))

    def _compile(self, sig: Signature, key: ExeKey, i: int, base: StageKey):
        """Compile stage ``i``'s executable ``key`` for ``sig``."""
        lay = self.store.layouts[i]
        f = gathered(self.traced_fns[i], self.layout.gathered_sharding(sig.replicated))
        act_of = functools.partial(self.layout.act, replicated=sig.replicated)
        pspec, hspec = lay.param_spec(), self._spec(sig.chain[i], act_of(sig.chain[i]))
        if key.kind == "forward":
            return jax.jit(f, out_shardings=act_of(sig.chain[i + 1])).lower(pspec, hspec).compile()
        if key.kind == "forward-save":
            return self._compile_forward_save(sig, i, f, base, pspec, hspec, act_of(sig.chain[i + 1]))
        return self._compile_backward(sig, i, f, base, key, pspec, hspec)

    def _compile_backward(self, sig: Signature, i: int, f, base: StageKey, key: ExeKey, pspec, hspec):
        """Compile stage ``i``'s backward ``key``: its vjp (recomputing the forward, or from the residuals of
        ``forward-save``), the gradients out, summed into the accumulator, or the optimizer update fused."""
        lay, act = self.store.layouts[i], self.layout.activation_sharding
        act_of = functools.partial(self.layout.act, replicated=sig.replicated)
        hin, hout = sig.chain[i], sig.chain[i + 1]
        gout = split_diff(hout)[0]
        gspec = self._spec(gout, act_of(gout))
        gin_sh = act_of(split_diff(hin)[0])  # the input cotangent's
        # the output cotangent may reuse the input cotangent's buffer (same avals)
        same = aval_key(split_diff(hin)[0]) == aval_key(gout)
        if key.kind == "backward-saved":
            fwd_save = self.exe(sig, ExeKey("forward-save"), i)
            core = saved_vjp(*sig.saved_layout[base])
            sspec = jax.tree_util.tree_map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                           fwd_save.out_info[1], fwd_save.output_shardings[1])
            specs = (pspec, hspec, sspec, gspec)
        else:
            core = recompute_vjp(f, list(lay.train_mask))
            specs = (pspec, hspec, gspec)
        g_arg = len(specs) - 1
        donate_argnums = (0, g_arg) if same else (0,)
        if key.mode is BackwardMode.GRADS:
            fn, out_sh = core, (gin_sh, list(lay.grad_device))
        else:
            if key.takes_acc:
                specs = specs + (lay.acc_spec(),)
                if key.mode is BackwardMode.ACCUM:  # the sum reuses the accumulator's buffer (not the weights')
                    donate_argnums = tuple(a for a in donate_argnums if a != 0) + (len(specs) - 1,)
            if key.mode is BackwardMode.ACCUM:
                fn, out_sh = with_accum(core, key.takes_acc), (gin_sh, list(lay.acc_device), act)
            else:
                fn = with_update(core, list(lay.train_mask), lay.groups, key.takes_acc)
                specs = specs + (lay.state_spec(self.store.optimizer_state[i]), self._hyper_spec())
                donate_argnums += (len(specs) - 2,)
                out_sh = (gin_sh, lay.device_sharding, list(lay.state_device))
        return jax.jit(fn, out_shardings=out_sh, donate_argnums=donate_argnums if key.donate else ()
                       ).lower(*specs).compile()

    def _hyper_spec(self):
        """The spec of a step's hyperparameter rows: float32 ``[num_groups, HYPER_WIDTH]``."""
        return jax.ShapeDtypeStruct((self.num_groups, HYPER_WIDTH), np.float32,
                                    sharding=self.layout.activation_sharding)

    def update_exes(self, donate: bool) -> list:
        """The update pass's executables, one per stage (compiled on first use, shared by stages of
        equal parameter key): ``(p, acc, state, hyper, coef) -> (new_p, new_state)``."""
        exes = []
        for i, lay in enumerate(self.store.layouts):
            key = (lay.param_key(), donate)
            exe = self.update_cache.get(key)
            if exe is None:
                cspec = jax.ShapeDtypeStruct((), np.float32, sharding=self.layout.activation_sharding)
                exe = jax.jit(update_only(list(lay.train_mask), lay.groups),
                              out_shardings=(lay.device_sharding, list(lay.state_device)),
                              donate_argnums=(0, 2) if donate else ()).lower(
                                  lay.param_spec(), lay.acc_spec(), lay.state_spec(self.store.optimizer_state[i]),
                                  self._hyper_spec(), cspec).compile()
                self.update_cache.put(key, exe)
            exes.append(exe)
        return exes

    def _compile_forward_save(self, sig, i: int, f, base: StageKey, pspec, hspec, out_sh):
        """Compile stage ``i``'s ``(p, x) -> (y, saved)`` (``f`` its function as traced): its output and its vjp residuals (w.r.t. its
        trainable leaves and the floating leaves of ``x``) minus ``p`` and ``x``.

        ``jax.vjp`` returns its residuals as the leaves of the vjp function (a pytree); while
        tracing, residuals that *are* the traced weights or stage input (identity) are
        recorded as such in ``sig.saved_layout[base]`` and not returned, so the weights
        are not kept on the device between the passes.
        """
        layout_out = {}
        remat = without_gathered(self.remat) if sig.replicated else self.remat
        fwd_save = forward_save_fn(f, remat, layout_out, list(self.store.layouts[i].train_mask))
        try:
            exe = jax.jit(fwd_save, out_shardings=(out_sh, None)).lower(pspec, hspec).compile()
        except ValueError as e:
            # The partitioner may pick a residual sharding that jax cannot express over the mesh
            # (IndivisibleError, seen for a [1, 4, 1, 2] attention residual over 8 devices): keep
            # those residuals in the activation sharding instead.
            if "divisible" not in str(e):
                raise
            exe = jax.jit(fwd_save, out_shardings=(out_sh, self.layout.activation_sharding)
                          ).lower(pspec, hspec).compile()
        sig.saved_layout[base] = layout_out["layout"]
        return exe

    def loss_exe(self, loss_fn, out_aval, loss_args):
        """The jitted ``(out, *loss_args) -> (loss, d loss / d out)`` of ``loss_fn`` (cached per object),
        its output checked once per signature to be a floating scalar (ValueError otherwise)."""
        args_aval = tuple(tree_aval(a, f"loss_args[{j}]") for j, a in enumerate(loss_args))
        skey = (loss_fn, aval_key(out_aval), tuple(aval_key(a) for a in args_aval))
        try:
            known = self.loss_shapes.get(skey)
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
                if len(self.loss_shapes) >= 4 * MAX_LOSS_FNS:
                    self.loss_shapes.clear()
                self.loss_shapes[skey] = True
        jitted = self.loss_jits.get(loss_fn) if skey is not None else None
        if jitted is None:
            def value_and_grad(out, *args, loss_fn=loss_fn):
                od, oc, os_ = split_diff(out)
                return jax.value_and_grad(lambda od: loss_fn(merge_diff(od, oc, os_), *args))(od)

            # with batch_axis the gradient keeps the output's sharding (placed by the caller)
            grad_sharding = self.layout.activation_sharding if self.layout.batch_sharding is None else None
            jitted = jax.jit(value_and_grad, out_shardings=(None, grad_sharding))
            if skey is not None:
                for evicted, _ in self.loss_jits.put(loss_fn, jitted):
                    self.loss_shapes = {k: v for k, v in self.loss_shapes.items() if k[0] is not evicted}
                    if not self._warned_loss:
                        self._warned_loss = True
                        warnings.warn("StreamingRuntime.train_step: more than "
                                      f"{MAX_LOSS_FNS} distinct loss_fn objects; each new one compiles again. "
                                      "Pass per-step data through loss_args instead of a new closure.",
                                      stacklevel=5)
        return jitted

    def train_loss_exe(self, h, loss_fn, cotangent, loss_args):
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
        sig = self.signature(h)
        if not any(split_diff(lay.param_aval)[0] for lay in self.store.layouts):
            raise TypeError("train_step: no stage has a floating parameter; nothing to differentiate")
        out_aval = sig.chain[-1]
        out_diff = split_diff(out_aval)[0]
        if not out_diff:
            raise TypeError(f"train_step: the output ({describe(out_aval)}) has no floating leaf; "
                            "gradients need a floating output")
        if cotangent is None:
            return self.loss_exe(loss_fn, out_aval, loss_args)
        given = tree_aval(cotangent, "cotangent")
        if aval_key(given) != aval_key(out_diff) and aval_key(given) != aval_key(out_aval):
            raise ValueError(f"cotangent has {describe(given)}, but the output has {describe(out_aval)}")
        return None
