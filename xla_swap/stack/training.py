"""Training of the torch entry point: the :class:`Trainer` a ``SwappedStack`` holds and calls for
``train_step``, with what it needs of a torch optimizer (:func:`torch_param_groups`).

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
from xla_swap.executors.pytrees import check_input_dtypes, tree_aval
from xla_swap.stack.checks import class_target_bounds
from xla_swap.planning.optimizer import AdamW
from xla_swap.stack.config import TrainingConfig
from xla_swap.stack.stages import StageLayout
from xla_swap.stack.checks import meta_tensor
from xla_swap.stack.torch_bridge import inputs_to_jax, to_torch, torch_fn

__all__ = ["Trainer", "torch_param_groups", "MAX_LOSS_FUNCTIONS", "loss_key"]

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



def torch_param_groups(opt: torch.optim.Optimizer, names: list[str], modules: list, owner: dict) -> dict[int, int]:
    """``{id(parameter): param_group index}`` of a torch optimizer over the stack's parameters (``owner``:
    ``{id(parameter): stage}``, :func:`xla_swap.stack.stages.tied_parameters`).

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


class Trainer:
    """The training part of a ``SwappedStack``: it turns losses into jax functions, reads a torch optimizer's
    groups, runs a runtime's training step and, without an optimizer, hands the gradients back to torch.

    Args:
      layout: the stack's :class:`xla_swap.stack.stages.StageLayout` (modules, names, layouts).
      torch_env: the torchax environment the losses are traced in.
      optimizer: the update's ``AdamW`` (group 0's with a torch optimizer) or ``None``.
      torch_optimizer: the torch optimizer whose ``param_groups`` are read at every step, or ``None``.
      loss_fn: the default loss, or ``None``.
      config: the :class:`xla_swap.stack.config.TrainingConfig` (clipping, skipping, where gradients go).
        With ``max_grad_norm`` or ``skip_nonfinite`` the update needs every stage's gradients first,
        so it is no longer fused into the backward: the backward sends each layer's gradients to
        ``pinned_host`` and an update pass streams weights, gradients and moments in and the new
        weights and moments out. Per update that moves, beyond the fused step, the gradients out
        and in (2 x the trainable weight bytes) and the weights in once more (less the
        ``prefetch_depth + 1`` layers the backward leaves on the device), and waits once for the norm.

    Attributes: ``last_grads`` (without an optimizer and ``accumulate_grads=False``: the last step's
    gradients, per stage ``{name: jax.Array}`` in ``pinned_host``), ``loss_functions`` (the converted losses
    kept, ``{loss_key: jax function}``, at most :data:`MAX_LOSS_FUNCTIONS`).
    """

    def __init__(self, layout: StageLayout, torch_env, optimizer: AdamW | None, torch_optimizer, loss_fn,
                 config: TrainingConfig):
        self.layout, self.torch_env = layout, torch_env
        self.optimizer, self.torch_optimizer, self.loss_fn = optimizer, torch_optimizer, loss_fn
        self.group_ids = [tuple(id(p) for p in g["params"]) for g in torch_optimizer.param_groups] \
            if torch_optimizer is not None else None
        self.config = config
        self.last_grads: list | None = None
        self.loss_functions: dict = {}

    def checked_loss(self, loss_fn: Callable | None, accumulate: bool) -> Callable:
        """The loss a ``train_step(loss_fn=..., accumulate=...)`` call uses (its own, else the default),
        checked with ``accumulate`` before anything runs. Raises the errors ``SwappedStack.train_step`` lists."""
        if loss_fn is None:
            loss_fn = self.loss_fn
        if loss_fn is None or not callable(loss_fn) or isinstance(loss_fn, torch.Tensor):
            raise TypeError("train_step needs a loss_fn (here or in the constructor): (output, *targets) -> scalar")
        if not isinstance(accumulate, bool):
            raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
        if self.optimizer is None and self.config.accumulate_grads:
            on_meta = meta_tensor(self.layout.modules, self.layout.names)
            if on_meta is not None:
                raise ValueError(f"{on_meta} is on the meta device: without an optimizer train_step adds the gradients "
                                 "to the modules' .grad; build the stack with an optimizer or "
                                 "TrainingConfig(accumulate_grads=False) (last_grads)")
        if accumulate and self.optimizer is None:
            raise ValueError("accumulate=True needs an optimizer; without one train_step adds the gradients to "
                             ".grad already (accumulate_grads)")
        return loss_fn

    def targets_in(self, runtime, targets, x, loss_fn: Callable) -> tuple:
        """``targets`` as jax / numpy arrays (a tuple), checked before any state changes: dtypes, and the
        class indices among them (:func:`xla_swap.stack.checks.class_target_bounds`, ``C`` the last
        dimension of the output ``runtime`` gives for input ``x``; IndexError naming the target)."""
        if targets is None or (isinstance(targets, tuple) and not targets):
            return ()
        out = runtime.output_aval(x)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out = out[0]   # no `last` stage: the output is the layers' (h, layer_kwargs) carry
        shape, per_rank = getattr(out, "shape", None), per_rank_batches()
        if per_rank and shape and shape[0] % world_size() == 0:   # the output rows of this rank's batch
            shape = (shape[0] // world_size(),) + tuple(shape[1:])
        bounds = class_target_bounds(targets, shape, loss_fn)
        jax_targets = inputs_to_jax(targets if isinstance(targets, (tuple, list)) else (targets,), "targets",
                                    functools.partial(runtime.loss_args_sharding_of, tree_aval(x, "inputs")),
                                    bounds=bounds, per_rank=per_rank)
        check_input_dtypes(jax_targets, "targets")
        return jax_targets

    def param_groups(self) -> list[AdamW] | None:
        """The torch optimizer's groups now (a scheduler may have changed them), one ``AdamW`` each; ``None``
        without a torch optimizer.

        Raises: ValueError: the groups' parameters changed since construction; the errors of
        ``AdamW.groups_from_torch`` (e.g. ``amsgrad`` switched on).
        """
        opt = self.torch_optimizer
        if opt is None:
            return None
        if [tuple(id(p) for p in g["params"]) for g in opt.param_groups] != self.group_ids:
            raise ValueError("optimizer.param_groups hold other parameters than when the SwappedStack was built "
                             "(add_param_group, or parameters moved between groups); build a new SwappedStack")
        return AdamW.groups_from_torch(opt, self.optimizer.state_dtype)

    def step(self, runtime, x, jax_targets: tuple, loss_fn: Callable, lr, accumulate: bool) -> torch.Tensor:
        """One step of ``runtime`` on checked input ``x`` and targets: the loss, a 0-d float32 CPU tensor. After an
        update the torch optimizer's ``step()`` runs (a no-op on its parameters: its hooks and a scheduler see a
        step); without an optimizer the gradients go to ``.grad`` or ``last_grads`` (``accumulate_grads``)."""
        step = runtime.step
        cfg = self.config   # max_grad_norm and skip_nonfinite are the runtime's own (its RuntimeConfig)
        loss, _, grads = runtime.train_step(x, self.jax_loss(loss_fn), loss_args=tuple(jax_targets), lr=lr,
                                            accumulate=accumulate)
        if self.torch_optimizer is not None and runtime.step > step:
            opt = self.torch_optimizer
            if all(p.grad is None for g in opt.param_groups for p in g["params"]):
                opt.step()
        if grads is not None:
            if cfg.accumulate_grads:
                self._accumulate_grads(grads)
            else:
                self.last_grads = grads
        return to_torch(loss).float()

    def jax_loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` as a JAX function ``(output, *targets) -> scalar``, converted once per
        :func:`loss_key` (the :data:`MAX_LOSS_FUNCTIONS` latest kept)."""
        key = loss_key(loss_fn)
        jax_loss = self.loss_functions.get(key)
        if jax_loss is None:
            loss_in_jax = torch_fn(loss_fn, self.torch_env)

            def jax_loss(out, *targets):
                if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
                    out = out[0]  # no `last` stage: the output is the layers' (h, layer_kwargs) carry
                return loss_in_jax(out, *targets)
            if len(self.loss_functions) >= MAX_LOSS_FUNCTIONS:
                self.loss_functions.pop(next(iter(self.loss_functions)))
            self.loss_functions[key] = jax_loss
        return jax_loss

    def _accumulate_grads(self, grads) -> None:
        """Add ``grads`` (per stage ``{name: jax.Array}``, host layout) to the modules' ``.grad``, in torch's layout."""
        layout = self.layout
        for i, (m, g, names) in enumerate(zip(layout.modules, grads, layout.trainable)):
            params = dict(m.named_parameters())
            for n in names:
                if g.get(n) is None:
                    continue
                gt = layout.torch_layout(i, n, to_torch(g[n])).to(params[n].dtype)
                if params[n].grad is None:
                    params[n].grad = gt
                else:
                    params[n].grad.add_(gt)
