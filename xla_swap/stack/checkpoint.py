"""Checkpoints of the torch entry point: ``SwappedStack.state_dict`` / ``load_state_dict`` (torch's
``get_state_dict`` form) and ``save_checkpoint`` / ``load_checkpoint`` (``torch.distributed.checkpoint``,
DCP), by the :class:`Checkpointer` a ``SwappedStack`` holds and calls.

Saving streams: a DCP save planner (:func:`xla_swap.stack.checkpoint_dcp.streaming_save_planner`) copies
each shard out of its ``pinned_host`` buffer only when the writer asks for it; with several jax
processes each writes its own devices' shards in one DCP save over ``torch.distributed``. Loading
checks every key, shape and dtype first, then restores one stage at a time
(``StreamingRuntime.load_stage``), each process reading only the regions its devices hold, so a
checkpoint loads with any number of processes and devices.

The module imports torch (``torch.distributed.checkpoint`` when used) and jax.
"""
from __future__ import annotations

from typing import Callable

import jax
import torch

from xla_swap.stack.checkpoint_dcp import (assembled, quiet_dcp, region_load_planner, shard_chunks, shard_regions,
                                           streaming_save_planner)
from xla_swap.planning.optimizer import AdamW
from xla_swap.stack.stages import StageLayout
from xla_swap.stack.torch_bridge import to_torch, torch_dtype

__all__ = ["Checkpointer", "model_parameter_names"]


def model_parameter_names(modules: list, first) -> dict:
    """``{(stage index, parameter name in the stage): name in the model}`` where ``first`` names the
    stages' parameters as a model the stages were cut from does (``first.parameter_names``:
    ``{id(parameter): name}``, e.g. a PEFT model's, :mod:`xla_swap.hf.peft_models`); ``{}`` otherwise."""
    given = getattr(first, "parameter_names", None) if first is not None else None
    if not isinstance(given, dict):
        return {}
    return {(i, n): given[id(p)] for i, m in enumerate(modules) for n, p in m.named_parameters() if id(p) in given}


#: the torch optimizer's state key of each moment kind of ``SwappedStack._ckpt_layout``.
_MOMENT_KEYS = {"m": "exp_avg", "v": "exp_avg_sq", "step": "step"}


def _check_process_group(what: str) -> None:
    """RuntimeError unless ``torch.distributed`` is initialized over as many processes as jax spans."""
    import torch.distributed as dist
    n = jax.process_count()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what}: the stack spans {n} jax processes and torch.distributed is not initialized; "
                           "the processes write one checkpoint through a torch.distributed process group: call "
                           "xla_swap.distributed.initialize() (under torchrun) or "
                           "torch.distributed.init_process_group('gloo') in every process first")
    if dist.get_world_size() != n:
        raise RuntimeError(f"{what}: torch.distributed's world size is {dist.get_world_size()}, jax spans {n} "
                           "processes; initialize torch.distributed over the same processes")


class Checkpointer:
    """The checkpoints of a ``SwappedStack``: its training state read from and written into a runtime
    (host weights, optimizer state, step) in torch's names and layout.

    Args:
      layout: the stack's :class:`xla_swap.stack.stages.StageLayout` (names, layouts, trainable names).
      optimizer: the update's ``AdamW`` (group 0's with a torch optimizer) or ``None``.
      torch_optimizer: the torch optimizer whose ``param_groups`` are saved and restored, or ``None``.

    Each method takes the ``runtime`` (a ``StreamingRuntime`` of the stack's stages) it reads or restores.
    """

    def __init__(self, layout: StageLayout, optimizer: AdamW | None, torch_optimizer):
        self.layout, self.optimizer, self.torch_optimizer = layout, optimizer, torch_optimizer

    def state_dict(self, rt) -> dict:
        """The whole training state as CPU torch tensors (copies), in torch's layout and names.

        ``{"model": {fqn: weight}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}},
        "param_groups": [...]}}``, the form of ``torch.distributed.checkpoint.state_dict
        .get_state_dict``: ``fqn`` is the stage's name with the parameter's (``first.embed_tokens.weight``,
        ``layers.0.self_attn.q_proj.weight``, ``last.lm_head.weight``), or for stages cut from a PEFT model
        the PEFT model's own name (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``,
        ``checkpoint_names``); weights and moments are
        ``[out, in]`` for ``nn.Linear`` weights as torch holds them, in the dtypes the stack holds
        (moments: the optimizer's state dtype); ``step`` is a 0-d float32 tensor (the optimizer's
        step count, as ``torch.optim.AdamW`` keeps it); each param group holds its options and its
        parameters' fqns. Parameters with ``requires_grad=False`` have weights and no state;
        without an optimizer only ``"model"`` is there. This is one copy of the whole state in host
        memory: :meth:`save_checkpoint` writes it without one.

        Raises: ValueError: accumulated micro-batches are pending (``train_step(accumulate=True)``
          since the last update: their gradients are not part of the state; update first); the
          stack spans several processes.
        """
        self._check_checkpointable(rt, "state_dict")
        sd: dict = {"model": {}}
        if self.optimizer is not None:
            sd["optim"] = {"state": {}, "param_groups": self._param_groups_state(rt)}
        for i, stage_layout in enumerate(self._ckpt_layout(rt)):
            for key, (fqn, name, kind, j, _, _) in stage_layout.items():
                t = self._ckpt_tensor(rt, i, name, kind, j)
                if kind == "w":
                    sd["model"][fqn] = t
                else:
                    sd["optim"]["state"].setdefault(fqn, {})[_MOMENT_KEYS[kind]] = t
        return sd

    def load_state_dict(self, rt, state_dict: dict) -> None:
        """Restore the training state from a :meth:`state_dict` (of this stack or another built the
        same way): weights and moments are copied into the stack's host buffers, stage by stage,
        with their shardings and memory kinds; the step count and the param groups' options (into
        the torch optimizer's ``param_groups``, as ``optimizer.load_state_dict`` does) follow.

        Raises (before anything changes): TypeError: ``state_dict`` is not a dict of that form.
          ValueError: keys missing or unexpected (another model or config; the message names
          them), a tensor of another shape or dtype (named), steps that differ between
          parameters, param groups of other parameters or options AdamW refuses; accumulated
          micro-batches are pending; the stack spans several processes.
        """
        self._check_checkpointable(rt, "load_state_dict")
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("model"), dict) or \
                ("optim" in state_dict and not isinstance(state_dict["optim"], dict)):
            raise TypeError("state_dict must be a dict {'model': {fqn: tensor}, 'optim': {...}} as "
                            f"SwappedStack.state_dict() returns, got {type(state_dict).__name__}")
        flat = {f"model.{k}": v for k, v in state_dict["model"].items()}
        optim = state_dict.get("optim", {})
        for fqn, st in (optim.get("state") or {}).items():
            if not isinstance(st, dict):
                raise TypeError(f"state_dict['optim']['state'][{fqn!r}] must be a dict, got {type(st).__name__}")
            flat.update({f"optim.state.{fqn}.{k}": v for k, v in st.items()})
        for k, v in flat.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"state_dict: {k} must be a torch.Tensor, got {type(v).__name__}")
        meta = {k: (tuple(v.shape), v.dtype) for k, v in flat.items()}

        def read(regions):
            for k, pieces in regions.items():
                for off, t in pieces.items():
                    t.copy_(flat[k][tuple(slice(o, o + s) for o, s in zip(off, t.shape))])
        self._restore(rt, meta, read, optim.get("param_groups"), "state_dict")

    def save(self, rt, path, *, extra: dict | None = None) -> None:
        """Write :meth:`state_dict` as a ``torch.distributed.checkpoint`` (DCP) checkpoint into the
        folder ``path`` (created; files of an earlier checkpoint there are overwritten).

        The keys are ``state_dict()``'s flattened as DCP flattens a nested dict (``model.<fqn>``,
        ``optim.state.<fqn>.exp_avg``, ``optim.param_groups``, ``extra.<key>``), so
        ``torch.distributed.checkpoint.load`` reads it into torch tensors of those shapes. A weight
        sharded over several devices (``shard="fsdp"``) is written as one chunk per distinct shard,
        each copied from its own host buffer when the writer reaches it and released once written:
        the extra host memory is a few copies of the largest single shard (the shard read out of
        its buffer, its ``[out, in]`` transpose, the writer's serialization; at most four), never
        the model or one stage. Not measured: derived from the writer's one-item-at-a-time loop.

        With several jax processes (``jax.distributed``), every process calls this with the same
        ``path`` (a folder all of them see: a shared file system across hosts): it is one DCP save
        over ``torch.distributed``'s default process group, each process writing its own devices'
        shards into its own files (``__<rank>_0.distcp``; a piece held by devices of several
        processes, e.g. a replicated bias, by one of them) and rank 0 the ``.metadata`` file. The
        step, the param groups and ``extra`` are written by jax process 0 (pass the same ``extra``
        everywhere). Such a checkpoint loads with any number of processes (:meth:`load_checkpoint`).

        Args:
          path: a folder (``str`` or ``os.PathLike``).
          extra: ``None`` or a dict ``{str: picklable}`` saved beside the state, e.g.
            ``{"scheduler": sched.state_dict()}`` (:meth:`load_checkpoint` returns it).

        Raises (before anything is written): TypeError: ``path`` or ``extra`` of the wrong type.
          ValueError: pending micro-batches (as :meth:`state_dict`). RuntimeError: the stack spans
          several jax processes and ``torch.distributed`` is not initialized (call
          ``xla_swap.distributed.initialize()`` or ``torch.distributed.init_process_group("gloo")``
          in every process), or its world size is not the number of jax processes.
        """
        import os

        import torch.distributed.checkpoint as dcp
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike folder, got {type(path).__name__}")
        if extra is not None and (not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra)):
            raise TypeError(f"extra must be None or a dict with str keys, got {type(extra).__name__}")
        self._check_checkpointable(rt, "save_checkpoint", several_processes=True)
        several = jax.process_count() > 1
        if several:
            _check_process_group("save_checkpoint")
        lead = jax.process_index() == 0
        tensors = {}
        for i, stage_layout in enumerate(self._ckpt_layout(rt)):
            for key, (fqn, name, kind, j, shape, dtype) in stage_layout.items():
                if kind == "step":
                    step = [((), (), lambda: torch.tensor(float(rt.step)))]
                    tensors[key] = (shape, dtype, step if lead else [], 1)
                else:
                    tensors[key] = (shape, dtype, *shard_chunks(self._ckpt_source(rt, i, name, kind, j),
                                                                name in self.layout.transposed[i]))
        objects = {f"extra.{k}": v for k, v in (extra or {}).items()}
        if self.optimizer is not None:
            objects["optim.param_groups"] = self._param_groups_state(rt)
        os.makedirs(path, exist_ok=True)
        # per_thread_copy_ahead=0: the writer resolves (copies) one shard, writes it, then the next
        writer = dcp.FileSystemWriter(path, per_thread_copy_ahead=0)
        with quiet_dcp():
            dcp.save({}, storage_writer=writer, planner=streaming_save_planner(tensors, objects if lead else {}),
                     no_dist=not several)

    def load(self, rt, path) -> dict:
        """Restore the training state from a :meth:`save_checkpoint` folder, as :meth:`load_state_dict`
        does, one stage at a time.

        The checkpoint may come from any number of processes and devices: each process reads only
        the regions of each tensor its own devices' shards hold (DCP reshards: a region may span
        chunks another process wrote), with no collective (``torch.distributed`` need not be
        initialized; with several jax processes every process calls this, the folder visible to
        all). Extra host memory per process: about three times its share of one stage's weights
        and moments (the regions read, the arrays built from them, the runtime's new buffers).

        The checkpoint's keys, shapes and dtypes (its metadata), its step counts and param groups
        are checked before anything changes. Should reading a stage's data fail after that (a
        truncated file), the error says which stages were restored already.

        Returns: the ``extra`` dict given to :meth:`save_checkpoint` (``{}`` without one).

        Raises: TypeError: ``path`` not a str / ``os.PathLike``. FileNotFoundError: no DCP
          checkpoint in ``path``. ValueError: as :meth:`load_state_dict` (the message names the key).
        """
        import os

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike folder, got {type(path).__name__}")
        self._check_checkpointable(rt, "load_checkpoint", several_processes=True)
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise FileNotFoundError(f"path={os.fspath(path)!r} holds no torch.distributed.checkpoint checkpoint "
                                    "(no .metadata file)")
        md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        meta = {k: (tuple(v.size), v.properties.dtype) for k, v in md.items()
                if isinstance(v, TensorStorageMetadata) and not k.startswith("extra.")}
        meta.update({k: None for k, v in md.items() if not isinstance(v, TensorStorageMetadata)
                     and not k.startswith("extra.") and k != "optim.param_groups"})
        objects = {k: None for k in md if k.startswith("extra.") or k == "optim.param_groups"}
        if objects:
            with quiet_dcp():
                dcp.load(objects, storage_reader=dcp.FileSystemReader(path), no_dist=True)

        def read(regions):
            with quiet_dcp():
                dcp.load({}, storage_reader=dcp.FileSystemReader(path), planner=region_load_planner(regions),
                         no_dist=True)
        self._restore(rt, meta, read, objects.get("optim.param_groups"), f"checkpoint {os.fspath(path)!r}")
        return {k[len("extra."):]: v for k, v in objects.items() if k.startswith("extra.")}

    def _check_checkpointable(self, rt, what: str, several_processes: bool = False) -> None:
        if rt.grad_acc is not None:
            raise ValueError(f"{what}: {rt.micro_batches} accumulated micro-batches are pending (train_step("
                             "accumulate=True) since the last update); their gradients are not part of the state: "
                             "finish the accumulation with train_step(accumulate=False) first")
        if jax.process_count() > 1 and not several_processes:
            raise ValueError(f"{what} is not implemented for a stack spanning {jax.process_count()} processes; "
                             "save_checkpoint / load_checkpoint are")

    def _ckpt_layout(self, rt) -> list[dict]:
        """Per stage ``{flat key: (fqn, name, kind, j, torch shape, torch dtype)}``; ``kind`` is ``"w"``
        (weight), ``"m"`` / ``"v"`` (moments of trainable leaf ``j``) or ``"step"``."""
        out = []
        for i, names in enumerate(self.layout.trainable):
            host, layout = rt.host_params[i], {}

            def torch_shape(a, n, i=i):
                return tuple(a.shape)[::-1] if n in self.layout.transposed[i] else tuple(a.shape)
            for n in names:
                fqn = self.layout.fqn(i, n)
                layout[f"model.{fqn}"] = (fqn, n, "w", None, torch_shape(host[n], n), torch_dtype(host[n].dtype))
            if self.optimizer is not None:
                name_of = {jax.tree_util.keystr((jax.tree_util.DictKey(n),)): n for n in names}
                for j, path in enumerate(rt.trainable_paths(i)):
                    n = name_of[path]
                    fqn, moment = self.layout.fqn(i, n), rt.optimizer_state[i][j][0]
                    for kind in ("m", "v"):
                        layout[f"optim.state.{fqn}.{_MOMENT_KEYS[kind]}"] = (fqn, n, kind, j, torch_shape(moment, n),
                                                                            torch_dtype(moment.dtype))
                    layout[f"optim.state.{fqn}.step"] = (fqn, n, "step", j, (), torch.float32)
            out.append(layout)
        return out

    @staticmethod
    def _ckpt_source(rt, stage: int, name: str, kind: str, j):
        return rt.host_params[stage][name] if kind == "w" else rt.optimizer_state[stage][j][0 if kind == "m" else 1]

    def _ckpt_tensor(self, rt, stage: int, name: str, kind: str, j) -> torch.Tensor:
        if kind == "step":
            return torch.tensor(float(rt.step))
        return self.layout.torch_layout(stage, name, to_torch(self._ckpt_source(rt, stage, name, kind, j)))

    def _param_groups_state(self, rt) -> list[dict]:
        """The param groups' options and their parameters' fqns (``"params"``), as torch's
        ``get_optimizer_state_dict`` gives them: the torch optimizer's groups, else the runtime's."""
        import copy
        fqn_of = {id(p): self.layout.fqn(i, n) for i, m in enumerate(self.layout.modules) for n, p in m.named_parameters()}
        if self.torch_optimizer is not None:
            return [{**copy.deepcopy({k: v for k, v in g.items() if k != "params"}),
                     "params": [fqn_of[id(p)] for p in g["params"]]} for g in self.torch_optimizer.param_groups]
        members: list[list[str]] = [[] for _ in rt.param_groups]
        for i, names in enumerate(self.layout.trainable):
            key_of = {jax.tree_util.keystr((jax.tree_util.DictKey(n),)): n for n in names}
            for path, g in zip(rt.trainable_paths(i), rt.group_idx[i]):
                members[g].append(self.layout.fqn(i, key_of[path]))
        return [{"lr": g.lr, "betas": g.betas, "eps": g.eps, "weight_decay": g.weight_decay, "params": ps}
                for g, ps in zip(rt.param_groups, members)]

    def _restore(self, rt, meta: dict, read: Callable, groups, where: str) -> None:
        """Check ``meta`` (``{flat key: (shape, torch dtype)}``) and ``groups`` against the stack, then
        load each stage and set the step and the groups. ``read(regions)`` fills ``regions``
        (``{flat key: {offsets: CPU tensor}}``) with those regions of the saved tensors.

        Raises ValueError naming the key before anything changes (see :meth:`load_state_dict`).
        """
        layout = self._ckpt_layout(rt)
        want = {k: v for stage_layout in layout for k, v in stage_layout.items()}
        missing, unexpected = sorted(set(want) - set(meta)), sorted(set(meta) - set(want))
        if missing or unexpected:
            raise ValueError(f"{where} does not match the stack (another model, config or optimizer?): "
                             f"{len(missing)} keys missing {missing[:4]}, {len(unexpected)} unexpected {unexpected[:4]}")
        for k, (_, _, _, _, shape, dtype) in want.items():
            if meta[k] != (tuple(shape), dtype):
                got = "an object" if meta[k] is None else f"shape {list(meta[k][0])} dtype {meta[k][1]}"
                raise ValueError(f"{where}: {k} has {got}, the stack holds shape {list(shape)} dtype {dtype}")
        step, new_groups = None, None
        if self.optimizer is not None:
            if groups is None:
                raise ValueError(f"{where} has no optim.param_groups")
            steps = {k: {(): torch.empty((), dtype=v[5])} for k, v in want.items() if v[2] == "step"}
            read(steps)
            vals = {float(r[()]) for r in steps.values()}
            if len(vals) > 1 or (vals and (not float(next(iter(vals))).is_integer() or next(iter(vals)) < 0)):
                raise ValueError(f"{where}: the parameters' steps differ or are not counts: {sorted(vals)[:4]}")
            step = int(next(iter(vals))) if vals else rt.step
            new_groups = self._checked_groups_state(rt, groups, where)
        for i, stage_layout in enumerate(layout):
            try:
                self._restore_stage(rt, i, stage_layout, read)
            except Exception as e:
                if i == 0:
                    raise
                raise RuntimeError(f"{where}: reading stage {self.layout.names[i]} failed after stages "
                                   f"{self.layout.names[0]}..{self.layout.names[i - 1]} were restored; load again") from e
        if self.optimizer is not None:
            rt.step = step
            if self.torch_optimizer is not None:
                for g, saved in zip(self.torch_optimizer.param_groups, groups):
                    g.update({k: v for k, v in saved.items() if k != "params"})
            rt.param_groups = new_groups

    def _restore_stage(self, rt, i: int, stage_layout: dict, read: Callable) -> None:
        """Read the regions of stage ``i``'s weights and moments this process's devices hold
        (``read`` as :meth:`_restore`'s) and put them into the runtime's host buffers."""
        sources, regions = {}, {}
        for k, (_, n, kind, j, _, dtype) in stage_layout.items():
            if kind != "step":
                sources[k] = self._ckpt_source(rt, i, n, kind, j)
                regions[k] = {off: torch.empty(sizes, dtype=dtype)
                              for off, sizes in shard_regions(sources[k], n in self.layout.transposed[i]).values()}
        read(regions)
        params, state = dict(rt.host_params[i]), {}
        for k, src in sources.items():
            _, n, kind, j, _, _ = stage_layout[k]
            a = assembled(src, n in self.layout.transposed[i], regions.pop(k))
            if kind == "w":
                params[n] = a
            else:
                state.setdefault(j, [None, None])[0 if kind == "m" else 1] = a
        rt.load_stage(i, params, [tuple(state[j]) for j in sorted(state)]
                                if self.optimizer is not None else None)

    def _checked_groups_state(self, rt, groups, where: str) -> list[AdamW]:
        """The runtime's groups for saved ``groups`` (``_param_groups_state`` form); ValueError if they
        hold other parameters than the stack's groups or options AdamW refuses."""
        mine = self._param_groups_state(rt)
        if not isinstance(groups, list) or len(groups) != len(mine) or not all(isinstance(g, dict) for g in groups):
            raise ValueError(f"{where}: optim.param_groups must be {len(mine)} dicts (the stack's groups), "
                             f"got {type(groups).__name__} of {len(groups) if isinstance(groups, list) else '?'}")
        out = []
        for gi, (g, m) in enumerate(zip(groups, mine)):
            if sorted(g.get("params", [])) != sorted(m["params"]):
                raise ValueError(f"{where}: optim.param_groups[{gi}] holds other parameters than the stack's group "
                                 f"{gi} ({len(g.get('params', []))} vs {len(m['params'])})")
            try:
                out.append(AdamW(lr=float(g["lr"]), betas=tuple(float(b) for b in g["betas"]), eps=float(g["eps"]),
                                 weight_decay=float(g["weight_decay"]), state_dtype=self.optimizer.state_dtype))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: optim.param_groups[{gi}]: {e!r}") from None
        return out
