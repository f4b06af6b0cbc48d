"""The decode machinery ``generate`` keeps in a ``SwappedStack`` between calls: per (batch, cache length,
placement) a :class:`Generator` (stage functions with a KV cache, a streamer, the token choice's executables),
held by the stack's :class:`Generators` registry, which also keeps the last call's figures.

:func:`decode_stage_fns` builds the stage functions of a decode step from the stack's modules (the model's own
code, each layer handed a :class:`xla_swap.hf.kv_cache.LayerKV`); :func:`memory_stats` reads a device's memory.

The module imports torch (through the stack's modules), torchax (through its environment) and jax.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from xla_swap.distributed import gather_ints
from xla_swap.executors.streaming.stateful_streamer import StatefulStreamer, state_nbytes
from xla_swap.executors.streaming.routed_experts import RoutedExperts
from xla_swap.hf.kv_cache import OFFSET, DecodeFirst, LayerKV, layer_kwargs
from xla_swap.stack.mixed_precision import stage_functions_in
from xla_swap.hf.moe_decode import routed_specs
from xla_swap.hf.sampling import next_token_step
from xla_swap.stack.stages import TIED
from xla_swap.stack.torch_attention import prefill_attention
from xla_swap.stack.torch_bridge import module_fn

__all__ = ["Generator", "Generators", "decode_stage_fns", "memory_stats"]


class Generator:
    """The stage functions and the streamer (a ``StatefulStreamer``, running by ``RoutedExperts`` with ``routing``) of
    one (batch, cache length, placement): its KV cache, prefetched weights and decode executables.

    Args:
      stack: a ``SwappedStack`` of ``causal_lm_stages(model)`` (read: ``runtime``, ``modules``, ``torch_env``,
        ``transposed``, ``tied``, ``layer_groups``, ``param_dtype``, ``matmul_precision``).
      batch, cache_len: the decode shapes; kv_cache: ``"auto"`` / ``"device"`` / ``"host"``; budget: bytes or
        ``None`` (``xla_swap.hf.generate``'s module docstring says how ``"auto"`` places the cache).
      routing, expert_layout: the routed-experts fetch (:mod:`xla_swap.hf.moe_decode`) or ``None``.
      expert_store: an ``ExpertStore`` a previous generator of the stack held (its packed experts are kept when
        the layout agrees), or ``None``.

    Raises: ValueError naming the stage that fails to trace with a KV cache.
    """

    def __init__(self, stack, batch: int, cache_len: int, kv_cache: str, budget: int | None, routing=None,
                 expert_layout: str = "auto", expert_store=None):
        rt = stack.runtime
        self.batch, self.cache_len = batch, cache_len
        self.runtime = rt   # (not the stack: no reference cycle through the stack's Generators)
        self.matmul_precision = stack.matmul_precision
        self.cache_kw = "cache" if "cache" in set(stack.modules[0].base_keywords) else "past_key_values"
        self._stage_fns = decode_stage_fns(stack, cache_len, self.cache_kw)
        avals = self._cache_avals(stack)
        #: per layer, bytes of its KV cache.
        self.kv_nbytes = [state_nbytes(a) for a in avals[1:-1]]
        self.kv_total = sum(self.kv_nbytes)
        self.window = (rt.prefetch_depth + 1) * max(rt.stage_nbytes) + sum(
            b for b, r in zip(rt.stage_nbytes, rt.resident) if r)
        self.placement, self.explanation = self._placement(kv_cache, budget, rt.activation_sharding)
        kw = dict(state_avals=avals, activation_sharding=rt.activation_sharding,
                  state_on_host=self.placement == "host", prefetch_depth=rt.prefetch_depth, resident=rt.resident,
                  gather_weights=rt.batch_axis is not None)
        #: with ``routing``, the routed-experts fetch the streamer runs its stages by (``RoutedExperts``,
        #: :mod:`xla_swap.hf.moe_decode`), else ``None`` (every expert streamed with its layer).
        self.routed_experts = None if routing is None else RoutedExperts(
            routed_specs(stack, routing, self._stage_fns), expert_layout, store=expert_store)
        self.streamer = StatefulStreamer(self._stage_fns, rt.host_params, rt.device_shardings, **kw,
                                         stage_calls=self.routed_experts)
        self._select_exes: dict = {}

    def close(self) -> None:
        """Give the stack its weights back as they were (the ``"split"`` expert layout's stacked arrays rebuilt)."""
        if self.routed_experts is not None:
            self.routed_experts.close(self.streamer)

    def _cache_avals(self, stack) -> list:
        """Per stage, the shape and dtype of its KV cache (``None`` for the first and last): a trace of
        each distinct layer function from a zero cache. Raises ValueError naming the stage that fails."""
        stage_fns, rt = self._stage_fns, self.runtime
        pav = [jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), p) for p in rt.host_params]
        with jax.default_matmul_precision(stack.matmul_precision):
            try:
                carry = jax.eval_shape(stage_fns[0], pav[0], self._inputs_aval(1))
            except ValueError:   # ours (names the base model and the keyword)
                raise
            except Exception as e:  # noqa: BLE001 - re-raised naming the stage
                raise ValueError(f"first ({type(stack.modules[0].base_module).__name__}.forward with a KV cache) does not "
                                 f"trace: {type(e).__name__}: {e}") from e
            avals: list = [None]
            seen: dict[int, Any] = {}
            for i in range(1, len(stage_fns) - 1):
                f = stage_fns[i]
                if id(f) not in seen:
                    try:
                        seen[id(f)] = jax.eval_shape(f, pav[i], None, carry)[1]
                    except ValueError:   # ours (names the layer class) or the model's own check
                        raise
                    except Exception as e:  # noqa: BLE001 - re-raised naming the layer
                        raise ValueError(f"layers[{i - 1}] ({type(stack.modules[i]).__name__}) does not trace with a "
                                         f"KV cache: {type(e).__name__}: {e}") from e
                avals.append(seen[id(f)])
            avals.append(None)
        return avals

    def _placement(self, kv_cache: str, budget: int | None, act) -> tuple[str, str]:
        """``(placement, explanation)`` of the KV cache: ``kv_cache`` itself unless ``"auto"`` (module docstring)."""
        if kv_cache != "auto":
            return kv_cache, f"kv_cache={kv_cache!r} given"
        free, source = budget, "device_budget_bytes"
        if free is None:
            stats = memory_stats(act)
            free = None if stats is None else stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
            if free is not None and jax.process_count() > 1:   # one choice for every process: the least free
                free = int(gather_ints([free]).min())
            source = "free device memory" if free is not None else "no memory statistics (CPU): fits"
        fits = free is None or self.kv_total + self.window <= free
        why = (f"KV cache {self.kv_total} B ({len(self.kv_nbytes)} layers x 2 x batch {self.batch} x cache_len "
               f"{self.cache_len} x kv_heads x head_dim x itemsize) + streaming window {self.window} B "
               f"{'<=' if fits else '>'} {source}" + (f" {free} B" if free is not None else ""))
        return ("device" if fits else "host"), why

    def _inputs_aval(self, t: int):
        b, L = self.batch, self.cache_len
        i32 = jnp.int32
        return (jax.ShapeDtypeStruct((b, t), i32), jax.ShapeDtypeStruct((b, L), i32),
                jax.ShapeDtypeStruct((b, t), i32), jax.ShapeDtypeStruct((), i32))

    def select_exe(self, sampling: tuple, n_eos: int, max_new: int, pad: int):
        """``(logits, state) -> state``: the next token, the rows still running and the next step's inputs
        (:func:`xla_swap.hf.sampling.next_token_step`, compiled once per argument set)."""
        key = (sampling, n_eos, max_new, pad)
        exe = self._select_exes.get(key)
        if exe is None:
            exe = jax.jit(next_token_step(sampling, n_eos, pad))
            self._select_exes[key] = exe
        return exe


def decode_stage_fns(stack, cache_len: int, cache_kw: str) -> list:
    """The stage functions of a decode step, in the streamer's form: ``first(w, inputs) -> (h, carry)``,
    each layer ``(w, kv, (h, carry)) -> ((h, carry), kv)``, ``last(w, (h, carry)) -> logits`` float32
    ``[B, V]`` of the last position. Layers of one group (``stack.layer_groups``) share one function."""
    first, last, env = stack.modules[0], stack.modules[-1], stack.torch_env
    n_layers = len(stack.modules) - 2
    layer_keys = list(first.layer_keys)
    tied, first_transposed = dict(stack.tied), stack.transposed[0]
    consts: dict[int, dict] = {}   # per group: the constant keyword values the model passes (found while tracing)
    seen_kw: dict[str, str] = {}    # "cache": the keyword the model hands its layers the cache in (found while tracing)
    first_fn = module_fn(DecodeFirst(first, env, cache_kw, cache_len, n_layers, layer_keys, consts, seen_kw), env,
                         first_transposed)

    def first_stage(w, inputs):
        h, kw = first_fn(w, tuple(inputs))
        kw = dict(kw)
        for name_last, name_first in tied.items():
            kw[TIED + name_last] = jnp.swapaxes(w[name_first], 0, 1) if name_first in first_transposed \
                else w[name_first]
        return h, kw

    fns = [first_stage]
    shared: dict = {}
    for i, m in enumerate(stack.modules[1:-1]):
        key = stack.layer_groups[i]   # groups of layers that compute the same thing (xla_swap.stack.stages.layer_groups)
        if key not in shared:
            layer_fn = module_fn(m, env, stack.transposed[1 + i])

            def layer_stage(w, x, layer_fn=layer_fn, g=layer_keys[i], cls=type(m).__name__):
                kv, (h, kw) = x
                cache = LayerKV(env, kv, kw[OFFSET], cache_len, n_layers)
                kwargs = layer_kwargs(kw, g)
                kwargs.update(consts.get(g, {}))
                kwargs[seen_kw.get("cache", cache_kw)] = cache
                with prefill_attention():   # a prefill's causal mask: cuDNN's causal kernel (checked on the device)
                    out = layer_fn(w, (h,), kwargs)
                if isinstance(out, (tuple, list)):
                    out = out[0]
                if not cache.updated:
                    name = seen_kw.get("cache", cache_kw)
                    raise ValueError(f"{cls} did not call {name}.update(keys, values, ...): "
                                     "generation needs decoder layers that keep a transformers-style KV cache")
                return (out, kw), cache.kv
            shared[key] = layer_stage
        fns.append(shared[key])
    last_fn = module_fn(last, env, stack.transposed[-1])

    def last_stage(w, carry):
        h, kw = carry
        if tied:
            w = {**w, **{n: kw[TIED + n] for n in tied}}
        logits = last_fn(w, (h[:, -1:],))
        return logits[:, 0].astype(jnp.float32)
    fns.append(last_stage)
    if stack.param_dtype is not None:
        fns = stage_functions_in(fns, stack.trainable_names, jnp.bfloat16, stack.cast_inputs)
    # the streamer's form: layers take (params, state, x)
    adapted: dict[int, Any] = {}
    for i, f in enumerate(fns[1:-1], start=1):
        if id(f) not in adapted:
            adapted[id(f)] = (lambda p, s, x, f=f: f(p, (s, x)))
        fns[i] = adapted[id(f)]
    return fns


def memory_stats(sharding) -> dict | None:
    try:
        d = next(d for d in sharding.device_set if d.process_index == jax.process_index())   # one of this process
        return d.memory_stats()
    except Exception:  # noqa: BLE001 - a platform without statistics
        return None


class Generators:
    """What generation keeps in a ``SwappedStack`` between ``generate`` calls: the :class:`Generator` of the
    last shapes (one at a time: a new one drops the previous KV cache) and the last call's figures (``last``:
    the dict ``stack.last_generation`` gives, or ``None`` before the first call; :meth:`record` sets it)."""

    def __init__(self):
        self._by_key: dict = {}
        self._last: dict | None = None

    @property
    def last(self) -> dict | None:
        """The last ``generate`` call's placement, explanation and figures, or ``None`` before the first."""
        return self._last

    def record(self, info: dict) -> None:
        """Keep ``info`` (a ``generate`` call's figures) as :attr:`last`."""
        self._last = info

    def get(self, stack, batch: int, cache_len: int, kv_cache: str, budget, routing=None,
            expert_layout: str = "auto") -> Generator:
        """The generator for these shapes of ``stack`` (arguments as :class:`Generator`'s), built when the
        shapes, placement, matmul precision, expert layout or the stack's runtime changed (the previous one's
        expert store handed over on the same runtime, else closed)."""
        rt = stack.runtime
        key = (batch, cache_len, kv_cache, budget, stack.matmul_precision, id(rt), routing is not None, expert_layout)
        gen = self._by_key.get(key)
        if gen is None or gen.runtime is not rt:
            old, store = self.current, None
            self._by_key.clear()
            if old is not None and old.routed_experts is not None:
                if old.runtime is rt and routing is not None:
                    store = old.routed_experts.expert_store
                else:
                    old.close()
            gen = Generator(stack, batch, cache_len, kv_cache, budget, routing, expert_layout, store)
            self._by_key[key] = gen
        return gen

    @property
    def current(self) -> Generator | None:
        """The generator kept (the last call's), or ``None``."""
        return next(iter(self._by_key.values()), None)

    def give_back(self) -> None:
        """Put the stack's weights back in its own form where a generator packed them (the ``"split"`` expert
        layout's stacked arrays rebuilt, :meth:`Generator.close`); the generators stay, and their next run
        packs again from the weights then current."""
        for gen in self._by_key.values():
            gen.close()

    def release(self) -> None:
        """Drop the generator kept: its KV cache (device or ``pinned_host``), the weights prefetched for the next
        step and the decode executables; the stack's weights as they were (:meth:`Generator.close`). The next
        ``generate`` builds them again."""
        self.give_back()
        self._by_key.clear()
