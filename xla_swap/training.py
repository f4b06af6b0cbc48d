"""Training of the torch entry point: ``SwappedStack.train_step`` and what it needs of a torch
optimizer, as the mixin :class:`TrainingMixin`.

A step converts the loss (a torch function) to jax with torchax once per loss function (at most
:data:`MAX_LOSS_FUNCTIONS` kept; a Python function recreated with the same code and the same values
it reads is the same loss, :func:`loss_key`), reads a torch optimizer's ``param_groups`` (a scheduler may
have changed them), runs ``StreamingRuntime.train_step`` and, without an optimizer, writes the
gradients into the modules' ``.grad``.

The module imports torch and jax.
"""
from __future__ import annotations

import functools
import types
from typing import Callable

import torch

from xla_swap.distributed import per_rank_batches, world_size
from xla_swap.executors._stages import check_input_dtypes, tree_aval
from xla_swap.index_checks import class_target_bounds
from xla_swap.planning.optimizer import AdamW
from xla_swap.stages import meta_tensor
from xla_swap.torch_bridge import inputs_to_jax, to_torch, torch_fn

__all__ = ["TrainingMixin", "MAX_LOSS_FUNCTIONS", "loss_key"]

#: converted loss functions a stack keeps (the oldest is dropped first).
MAX_LOSS_FUNCTIONS = 8
# What a loss function reads, keyed: a number, str, bool or None by value (a float by its bits: -0.0
# is not 0.0); a Python function by its own key; a module by identity and the attributes the code
# names; a builtin, class or dtype by identity. Anything else may change in place: not keyed.
_SCALARS = (int, float, bool, str, bytes, type(None))
_BY_IDENTITY = (types.BuiltinFunctionType, type, torch.dtype)
_MAX_DEPTH = 4   # functions and modules followed from the loss (a helper it calls, torch.nn.functional)


class _Same:
    """A key part equal to another only when both hold the same object; holding it keeps its id unique."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


class _NotKeyable(Exception):
    """A value a loss function reads that may change between calls (a tensor, a module, a list...)."""


def _value_key(v, names: frozenset, depth: int, parent: str | None = None):
    """The key of a value a loss reads; ``names``: the attribute names its code reads, followed into
    modules; ``parent``: the name of the module ``v`` is an attribute of."""
    kind = type(v)
    if kind in _SCALARS:
        return kind, (v.hex() if kind is float else v)
    if kind is tuple:
        return tuple, tuple(_value_key(x, names, depth, parent) for x in v)
    if isinstance(v, _BY_IDENTITY) or (parent is not None and kind is types.FunctionType):
        return _Same(v)   # a library function (F.cross_entropy) by identity: rebinding it is seen
    if isinstance(v, types.ModuleType) and parent is not None and not v.__name__.startswith(parent + "."):
        return _Same(v)   # a module another imports (torch.nn.functional.torch): not followed again
    if depth >= _MAX_DEPTH:
        raise _NotKeyable
    if kind is types.FunctionType:
        return _function_key(v, depth + 1)
    if isinstance(v, types.ModuleType):   # vars(), not getattr: no lazy submodule import
        attrs = vars(v)
        return _Same(v), tuple((n, _value_key(attrs[n], names, depth + 1, v.__name__)) for n in sorted(names)
                               if n in attrs)
    raise _NotKeyable


def _names(code: types.CodeType) -> frozenset:
    """Every global or attribute name ``code`` and the code nested in it (comprehensions, lambdas) read."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return frozenset(names)


def _function_key(fn: types.FunctionType, depth: int) -> tuple:
    """``fn``'s code with the values it reads: its closure cells, defaults and the globals it names."""
    g, names = fn.__globals__, _names(fn.__code__)
    builtins = g.get("__builtins__", {})
    builtins = vars(builtins) if isinstance(builtins, types.ModuleType) else builtins
    reads = tuple((n, _value_key(g[n], names, depth) if n in g else _Same(builtins[n]))
                  for n in sorted(names) if n in g or n in builtins)
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_value_key(cell.cell_contents, names, depth))
        except ValueError:   # an empty cell
            cells.append(None)
    defaults = tuple(_value_key(d, names, depth) for d in fn.__defaults__ or ())
    kwdefaults = tuple((k, _value_key(v, names, depth)) for k, v in sorted((fn.__kwdefaults__ or {}).items()))
    return fn.__code__, reads, tuple(cells), defaults, kwdefaults


def loss_key(loss_fn: Callable):
    """The key of ``loss_fn`` in a stack's cache of converted losses: equal keys, one compiled loss.

    A Python function (``def`` or ``lambda``) is keyed by its code (``__code__``) and the values it
    reads: closure cells, defaults and the globals its code names. A number, string, bool or
    ``None`` is compared by value; a Python function it reads by its own key; a module by
    identity and the attributes the code names (``F.cross_entropy``: rebinding it is seen); a
    builtin, a class or a dtype by identity. So a lambda recreated each step with the same code
    reading the same values is the same loss, and one closing over another value is not. A
    function reading anything else (a tensor, an ``nn.Module``, a list: it may change in place
    between calls) is keyed by the function object, as any other callable (a bound method by its
    object and function): recreated each step, it is converted and compiled each step.

    Returns: a hashable key (the callable itself when it is hashable and not keyed by code).
    """
    if type(loss_fn) is types.FunctionType:
        try:
            return _function_key(loss_fn, 0)
        except _NotKeyable:
            pass
    try:
        hash(loss_fn)
    except TypeError:
        return _Same(loss_fn)
    return loss_fn


class TrainingMixin:
    """The training methods of :class:`xla_swap.stack.SwappedStack` (it inherits them).

    They read the stack's ``runtime``, ``modules``, ``optimizer`` / ``torch_optimizer``,
    ``loss_fn``, ``accumulate_grads``, ``max_grad_norm`` and ``skip_nonfinite``.
    """

    def train_step(self, inputs, targets=(), *, loss_fn: Callable | None = None, lr: float | None = None,
                   accumulate: bool = False) -> torch.Tensor:
        """One training step: forward, ``loss_fn(output, *targets)``, backward, optimizer step.

        With ``accumulate=True`` (and an optimizer) it is one micro-batch: its gradients are added
        to the accumulated ones and nothing is updated; the next call with ``accumulate=False``
        adds its own and updates with the sum, as torch's ``loss.backward()`` per micro-batch and
        one ``optimizer.step()`` do (``.grad`` sums: divide the loss by the number of
        micro-batches, as torch's loop does, for their mean). An update clips and skips as the
        constructor's ``max_grad_norm`` / ``skip_nonfinite`` say (``last_grad_norm``,
        ``last_step_skipped``).

        Args:
          inputs: a torch tensor or a tuple of them (the arguments of ``first``).
          targets: a torch tensor or a tuple of them (CPU, or CUDA on any local GPU), passed to the
            loss after the output, laid out like it: split on the batch over the data-parallel
            devices where the output is, replicated (or on the stack's one device) otherwise. With
            per-rank batches (:mod:`xla_swap.distributed`) ``inputs`` and ``targets`` are this rank's.
          loss_fn: a torch function ``(output, *targets) -> scalar`` (default: the constructor's).
            Converted and compiled once per :func:`loss_key`: a lambda recreated each step with
            the same code, reading the same numbers, modules and functions, compiles once; one
            reading a tensor or an ``nn.Module`` compiles at each new function object (keep it,
            and pass per-step data as ``targets``).
          lr: this step's learning rate for every parameter group, overriding the optimizer's for
            this step only (a torch optimizer's ``param_groups`` are not changed). Default: each
            group's own ``lr`` (with a torch optimizer, read now: a ``torch.optim.lr_scheduler``
            stepping it is followed). Unused by an ``accumulate=True`` call (no update).
          accumulate: see above (a bool; needs an optimizer).

        Returns: the loss, a 0-d float32 CPU torch tensor. With an optimizer the weights are
        updated (in host memory: ``sync_modules()`` copies them into the modules); without
        one the gradients are added to the modules' ``.grad`` (CPU tensors).

        Raises (before any state changes):
          TypeError: ``inputs``/``targets`` not tensors; no ``loss_fn``; an input's dtype
            refused as in :meth:`forward`; a ``float64`` target with ``jax_enable_x64`` off;
            ``accumulate`` not a bool.
          IndexError: a token id outside the input embedding's rows, as in :meth:`forward`; a class
            index outside ``[0, C)`` other than the loss's ignore index, as ``cross_entropy`` raises:
            integer targets shaped like the output without its last dimension ``C`` (or that shape
            flattened) are class indices; the ignore index is ``-100`` unless ``loss_fn`` has an
            ``ignore_index`` (``nn.CrossEntropyLoss(ignore_index=...)``, a ``functools.partial``'s
            keyword, an attribute set on the function; ``None``: no target checked). Float targets and
            other shapes are not checked (:mod:`xla_swap.index_checks`).
          ValueError: the loss is not a floating scalar; a stage fails to trace; ``lr < 0``; the
            torch optimizer's groups hold other parameters than at construction, or an option
            the update does not implement (``AdamW.groups_from_torch``); ``accumulate=True``
            without an optimizer (``.grad`` accumulates already); without an optimizer and with
            ``accumulate_grads``, a parameter on the meta device (no ``.grad`` to add to).
        """
        if loss_fn is None:
            loss_fn = self.loss_fn
        if loss_fn is None or not callable(loss_fn) or isinstance(loss_fn, torch.Tensor):
            raise TypeError("train_step needs a loss_fn (here or in the constructor): (output, *targets) -> scalar")
        if not isinstance(accumulate, bool):
            raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
        if self.optimizer is None and self.accumulate_grads:
            on_meta = meta_tensor(self.modules, self.stage_names)
            if on_meta is not None:
                raise ValueError(f"{on_meta} is on the meta device: without an optimizer train_step adds the gradients "
                                 "to the modules' .grad; build the stack with an optimizer or accumulate_grads=False "
                                 "(last_grads)")
        if accumulate and self.optimizer is None:
            raise ValueError("accumulate=True needs an optimizer; without one train_step adds the gradients to "
                             ".grad already (accumulate_grads)")
        with self.torch_precision():
            return self._train_step(inputs, targets, loss_fn, lr, accumulate)

    def _train_step(self, inputs, targets, loss_fn, lr, accumulate) -> torch.Tensor:
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        x = self._carry_in(inputs)   # token ids checked, dtypes, the trace: nothing changes yet
        jax_targets = self._targets_in(targets, x, loss_fn)
        if self.torch_optimizer is not None:
            self.runtime.param_groups = self._read_torch_groups()
        runtime = self.runtime
        self._maybe_autotune(inputs, training=True)
        if self.runtime is not runtime:   # autotune chose a new runtime: the input as that one places it
            x = self._carry_in(inputs)
        step = self.runtime.step
        clip = dict(accumulate=accumulate, max_grad_norm=self.max_grad_norm, skip_nonfinite=self.skip_nonfinite) \
            if self.optimizer is not None else {}
        loss, _, grads = self.runtime.train_step(x, self._jax_loss(loss_fn), loss_args=tuple(jax_targets), lr=lr,
                                                 **clip)
        if self.torch_optimizer is not None and self.runtime.step > step:
            self._torch_step()
        if grads is not None:
            if self.accumulate_grads:
                self._accumulate_grads(grads)
            else:
                self.last_grads = grads
        return to_torch(loss).float()

    def _targets_in(self, targets, x, loss_fn: Callable) -> tuple:
        """``targets`` as jax / numpy arrays (a tuple), checked before any state changes: dtypes, and the
        class indices among them (:func:`xla_swap.index_checks.class_target_bounds`, ``C`` the last
        dimension of the output the stack gives for input ``x``; IndexError naming the target)."""
        if targets is None or (isinstance(targets, tuple) and not targets):
            return ()
        out = self.runtime.output_aval(x)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out = out[0]   # no `last` stage: the output is the layers' (h, layer_kwargs) carry
        shape, per_rank = getattr(out, "shape", None), per_rank_batches()
        if per_rank and shape and shape[0] % world_size() == 0:   # the output rows of this rank's batch
            shape = (shape[0] // world_size(),) + tuple(shape[1:])
        bounds = class_target_bounds(targets, shape, loss_fn)
        jax_targets = inputs_to_jax(targets if isinstance(targets, (tuple, list)) else (targets,), "targets",
                                    functools.partial(self.runtime.loss_args_sharding_of, tree_aval(x, "inputs")),
                                    bounds=bounds, per_rank=per_rank)
        check_input_dtypes(jax_targets, "targets")
        return jax_targets

    def _jax_loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` as a JAX function ``(output, *targets) -> scalar``, converted once per
        :func:`loss_key` (the :data:`MAX_LOSS_FUNCTIONS` latest kept)."""
        key = loss_key(loss_fn)
        jax_loss = self._jax_losses.get(key)
        if jax_loss is None:
            loss_in_jax = torch_fn(loss_fn, self.torch_env)

            def jax_loss(out, *targets):
                if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
                    out = out[0]  # no `last` stage: the output is the layers' (h, layer_kwargs) carry
                return loss_in_jax(out, *targets)
            if len(self._jax_losses) >= MAX_LOSS_FUNCTIONS:
                self._jax_losses.pop(next(iter(self._jax_losses)))
            self._jax_losses[key] = jax_loss
        return jax_loss

    @property
    def last_grad_norm(self) -> float | None:
        """The global 2-norm of the gradients of the last update (over every trainable parameter of
        every stage, before clipping: ``clip_grad_norm_``'s return value; a float, possibly inf or
        nan), or ``None`` when neither ``max_grad_norm`` nor ``skip_nonfinite`` is set."""
        return self.runtime.last_grad_norm

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last update was skipped for a non-finite gradient (``skip_nonfinite``)."""
        return self.runtime.last_step_skipped

    def _torch_step(self) -> None:
        """Call the torch optimizer's ``step()`` after an update, when none of its parameters has a
        ``.grad``: a no-op on its parameters and state that runs its step hooks and tells a
        ``torch.optim.lr_scheduler`` the optimizer stepped (else it warns that the scheduler
        stepped first)."""
        opt = self.torch_optimizer
        if all(p.grad is None for g in opt.param_groups for p in g["params"]):
            opt.step()

    def _accumulate_grads(self, grads) -> None:
        for i, (m, g, names) in enumerate(zip(self.modules, grads, self.trainable_names)):
            params = dict(m.named_parameters())
            for n in names:
                if g.get(n) is None:
                    continue
                gt = self._torch_layout(i, n, to_torch(g[n])).to(params[n].dtype)
                if params[n].grad is None:
                    params[n].grad = gt
                else:
                    params[n].grad.add_(gt)

    @staticmethod
    def _torch_groups(opt, names, modules, owner) -> dict[int, int]:
        """``{id(parameter): param_group index}`` of a torch optimizer over the stack's parameters.

        Raises: ValueError naming the parameter: a stage parameter with ``requires_grad`` in no
        group (torch would not train it, the stack would), or a group's parameter in no stage
        (the stack would never update it).
        """
        group_of = {}
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                if id(p) not in owner:
                    raise ValueError(f"optimizer.param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} that "
                                     "is in no stage of the stack (it would never be updated); give the optimizer "
                                     "the stages' parameters only")
                group_of[id(p)] = gi
        for name, m in zip(names, modules):
            for pn, p in m.named_parameters():
                if p.requires_grad and id(p) not in group_of:
                    raise ValueError(f"parameter {name}.{pn} requires grad but is in no param_group of the optimizer "
                                     "(torch would not update it); add it to a group or set requires_grad=False")
        return group_of

    def _read_torch_groups(self) -> list[AdamW]:
        """The torch optimizer's groups now (a scheduler may have changed them): one ``AdamW`` each.

        Raises: ValueError: the groups' parameters changed since construction; the errors of
        ``AdamW.groups_from_torch`` (e.g. ``amsgrad`` switched on).
        """
        opt = self.torch_optimizer
        if [tuple(id(p) for p in g["params"]) for g in opt.param_groups] != self._group_ids:
            raise ValueError("optimizer.param_groups hold other parameters than when the SwappedStack was built "
                             "(add_param_group, or parameters moved between groups); build a new SwappedStack")
        return AdamW.groups_from_torch(opt, self.optimizer.state_dtype)
