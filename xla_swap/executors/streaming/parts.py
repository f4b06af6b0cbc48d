"""The parts a ``StreamingRuntime`` holds, made together: :class:`RuntimeParts` builds them from checked
inputs (the constructor's) or from another runtime's parts under another ``RuntimeConfig`` (the same
stages, another configuration).

Imports only jax (no torch).
"""
from __future__ import annotations

import dataclasses

import jax

from .. import optim as _optim
from .compilation import StageCompiler
from .config import RuntimeConfig
from .instrumentation import ResidencyTracker, RuntimeInspector
from .calls import RuntimeCalls
from .placement import ActivationLayout
from .stage_store import StageStore, stage_layouts
from .optimizer_steps import OptimizerSteps
from ..pytrees import DEVICE_KIND, HOST_KIND

__all__ = ["RuntimeParts"]


@dataclasses.dataclass(frozen=True)
class RuntimeParts:
    """One runtime's parts, each owning its own state: its ``config`` (``RuntimeConfig``), ``layout``
    (``ActivationLayout``), ``steps`` (``OptimizerSteps``), ``store`` (``StageStore``), ``compiler``
    (``StageCompiler``), ``residency`` (``ResidencyTracker``), ``calls`` (``RuntimeCalls``) and
    ``inspector`` (``RuntimeInspector``)."""

    config: RuntimeConfig
    layout: ActivationLayout
    steps: OptimizerSteps
    store: StageStore
    compiler: StageCompiler
    residency: ResidencyTracker
    calls: RuntimeCalls
    inspector: RuntimeInspector

    @classmethod
    def build(cls, config: RuntimeConfig, fns: list, stage_params, avals: list, leaf_layout: tuple,
              layout: ActivationLayout, groups: list | None, optimizer_state, *, own_params: bool,
              step: int = 0) -> "RuntimeParts":
        """The parts over checked inputs: ``fns`` one stage function per stage, ``stage_params`` the weights,
        ``avals`` their ``jax.ShapeDtypeStruct`` pytrees, ``leaf_layout`` ``placement.leaf_shardings``'
        ``(host_sh, dev_sh, train_mask, group_idx)``, ``groups`` the optimizer's parameter groups or
        ``None``, ``optimizer_state`` the initial moments or ``None`` (zeros), ``step`` the steps done.

        Raises: ValueError: ``optimizer_state`` as ``StageStore.place_optimizer_state`` refuses it (the
          only input not checked before; nothing is kept then).
        """
        c = config
        layouts = stage_layouts(avals, *leaf_layout, resident=c.resident, grads_to_host=c.grads_to_host,
                                optimizer_state_on_host=c.optimizer_state_on_host, has_optimizer=groups is not None)
        steps = OptimizerSteps(groups, step)
        store = StageStore(stage_params, layouts, c.resident, steps.optimizer, own_params=own_params,
                           copy=groups is not None)
        store.place_optimizer_state(optimizer_state, own_state=own_params)
        compiler = StageCompiler(fns, store, layout, remat=c.remat, max_signatures=c.max_signatures,
                                 num_groups=steps.num_groups)
        residency = ResidencyTracker(c.track_residency, c.resident)
        calls = RuntimeCalls(c, store, compiler, layout, residency, steps)
        return cls(c, layout, steps, store, compiler, residency, calls,
                   RuntimeInspector(c, store, compiler, layout, residency, calls))

    def reconfigured(self, config: RuntimeConfig, *, own_params: bool) -> "RuntimeParts":
        """New parts over the same stages under ``config``: the same stage functions, activation layout,
        device shardings, trainable leaves and parameter groups; the current weights and moments placed
        where ``config`` keeps them (copies, or with ``own_params`` these arrays where they already sit);
        the optimizer's step count carried over. Nothing compiled is shared.

        Raises: ValueError: ``config`` is for another number of stages; the store holds accumulated
          gradients; TypeError / ValueError: ``param_groups`` no longer a valid optimizer.
        """
        store = self.store
        if config.num_stages != store.num_stages:
            raise ValueError(f"the configuration has {config.num_stages} stages, the runtime {store.num_stages}")
        if store.grad_acc is not None:
            raise ValueError(f"the runtime holds the gradients of {store.micro_batches} accumulated micro-batches; "
                             "reconfigure after the update (train_step with accumulate=False)")
        groups = _optim.check_optimizer(self.steps.param_groups)
        lays = store.layouts
        host_sh = [jax.tree_util.tree_map(lambda s, r=r: s.with_memory_kind(DEVICE_KIND if r else HOST_KIND),
                                          lay.device_sharding) for lay, r in zip(lays, config.resident)]
        leaf_layout = (host_sh, [lay.device_sharding for lay in lays], [lay.train_mask for lay in lays],
                       [lay.groups for lay in lays])
        return RuntimeParts.build(config, list(self.compiler.fns), list(store.host_params),
                                  [lay.param_aval for lay in lays], leaf_layout, self.layout, groups,
                                  store.optimizer_state if groups is not None else None, own_params=own_params,
                                  step=self.steps.step)
