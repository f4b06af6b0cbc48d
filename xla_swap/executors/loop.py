"""The loop of a streaming runtime: a ``forward`` or ``train_step`` call executed stage by stage,
weights (and optimizer state, accumulated gradients, offloaded activations) fetched
``prefetch_depth`` stages ahead, results sent back to host memory.

Imports only jax (no torch).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from .trace import StageEvent
from ._stages import HOST_KIND, aval_key, merge_diff, split_diff, tree_aval, tree_nbytes

__all__ = ["RuntimeLoop"]


class RuntimeLoop:
    """The loop part of :class:`xla_swap.executors.StreamingRuntime` (a base class of it, not used
    alone): ``_run`` compiles a call's executables, then streams it."""

    def _run(self, h, *, train: bool, loss_exe=None, cotangent=None, loss_args=(), hyper=None, trace=None,
             mode=None):
        sig = self._signature(h)
        n, k = self.num_stages, self.prefetch_depth
        recorder = trace if trace is not None else self.trace
        donate = self.donate and recorder is None
        # compile everything before the first transfer (errors surface before state changes)
        save = train and self.remat is not True
        fwd = [self._exe(sig, "forward-save" if save else "forward", i, False) for i in range(n)]
        bwd = None
        if train:
            # a resident stage's weights are not donated unless the optimizer replaces them; without
            # an optimizer, neither are the first k+1 stages' with prefetch_next_call (kept for the next call)
            kept_weights = [self.resident[i] or (self.prefetch_next_call and i <= k) for i in range(n)]
            has_acc = mode is not None and self.grad_acc is not None
            bwd = [self._exe(sig, "backward-saved" if save else "backward", i,
                             donate and (mode == "update" or not kept_weights[i]), mode=mode, acc=has_acc)
                   for i in range(n)]
        if save:
            self.residual_nbytes = [tree_nbytes(e.out_info[1]) for e in fwd]
        elif train:
            self.residual_nbytes = [0] * n
        hyper_arr = None
        if hyper is not None:
            hyper_arr = jax.device_put(np.asarray(hyper, np.float32), self.activation_sharding)

        self.residency_trace = []
        if recorder is not None:
            recorder.start()
        try:
            return self._stream(sig, h, fwd, bwd, recorder, n, k, train, loss_exe, cotangent, loss_args, hyper_arr,
                                mode if train else None)
        finally:
            if recorder is not None:
                recorder.stop()

    def _fetch(self, weights: dict, j: int, pass_name: str, recorder, states: dict | None = None,
               accs: dict | None = None) -> None:
        """Start moving stage j's weights (and, into ``states``, its optimizer state; into ``accs``, its
        accumulated gradients) to the device."""
        if states is not None and self.optimizer is not None and j not in states:
            states[j] = jax.device_put(self.optimizer_state[j], self._state_dev_sh[j])
        if accs is not None and j not in accs:
            accs[j] = jax.device_put(self.grad_acc[j], self._acc_dev_sh[j])
        if j in weights:
            return
        if self.resident[j]:
            weights[j] = self.host_params[j]
            return
        carried = self._carry.pop(j, None)
        if carried is not None and carried[0] is self.host_params[j]:
            weights[j] = carried[1]  # left in device memory by the previous call
            return
        ev = StageEvent(pass_name, j, "h2d", recorder.now()) if recorder is not None else None
        fetched = jax.device_put(self.host_params[j], self._dev_sh[j])
        self._track(fetched, j)
        weights[j] = fetched
        if recorder is not None:
            recorder.add(ev, fetched)

    def _stream(self, sig, h, fwd, bwd, recorder, n, k, train, loss_exe, cotangent, loss_args, hyper, mode):
        """Execute one call: the forward over every stage, then for ``train`` the loss (or the given
        cotangent) and the backward in reverse; returns ``(output,)`` or ``(loss or output, input
        cotangent, gradients or None)``."""
        call = _Call(sig=sig, recorder=recorder, save=train and self.remat is not True,
                     offload=train and self.offload_activations, num_first=min(k, n),
                     next_call={} if self.prefetch_next_call else None)
        if call.offload and call.save:
            call.residual_dev_sh = [list(e.output_shardings[1]) for e in fwd]
        call.offloaded = [False] * n
        call.saved = [None] * n
        self.offloaded_activation_nbytes = 0
        x = self._stream_forward(call, h, fwd, train)
        self._carry = {}  # whatever the forward did not take is stale
        if not train:
            if call.next_call is not None:
                self._carry = call.next_call
            return (x,)
        del x
        first = self._first_cotangent(call, loss_exe, cotangent, loss_args)
        host_grads = self._stream_backward(call, bwd, hyper, mode)
        if call.next_call is not None:
            self._carry = call.next_call
        input_cotangent = merge_diff(call.grad, None, split_diff(sig.in_aval)[2])
        return first, input_cotangent, host_grads

    def _stream_forward(self, call: "_Call", h, fwd: list, train: bool):
        """The forward: every stage in order, weights fetched ``prefetch_depth`` stages ahead; in
        training the stage inputs are kept in ``call.acts`` (``acts[n]`` the output). Returns the output."""
        n, k = self.num_stages, self.prefetch_depth
        x = jax.device_put(h, self._act(call.sig.chain[0]))
        # In training, the last k+1 stages stay for the start of the backward: once the forward
        # fetches nothing more, stage n-k-1's slot of the (k+1)-stage window would idle.
        call.kept_for_backward = set(range(max(0, n - k - 1), n)) if train else set()
        for j in range(call.num_first):
            self._fetch(call.weights, j, "forward", call.recorder)
        call.acts = [x] if train else None
        for i in range(n):
            y = self._forward_stage(call, fwd[i], i, x, train)
            x = y
            if train:
                call.acts.append(y)
        return x

    def _forward_stage(self, call: "_Call", exe, i: int, x, train: bool):
        """Dispatch stage ``i``'s forward on input ``x``, fetch the stage ``prefetch_depth`` ahead (or
        at the tail, the next call's first stages), offload the kept input; returns the stage's output."""
        n, k, recorder = self.num_stages, self.prefetch_depth, call.recorder
        p = call.weights[i]
        ev = StageEvent("forward", i, "compute", recorder.now()) if recorder is not None else None
        if call.save:
            y, call.saved[i] = exe(p, x)
        else:
            y = exe(p, x)
        if recorder is not None:
            recorder.add(ev, y)
        if self.throttle:
            jax.block_until_ready(x)  # stage i-1 done: its weights' memory is free
        if i + k < n:
            self._fetch(call.weights, i + k, "forward", recorder)
        elif call.next_call is not None and not train:
            self._keep_for_next_call(call, i + k - n)
        if call.offload and i not in call.kept_for_backward:
            self._offload_activations(call, i)
        self._record("forward", i)
        if i not in call.kept_for_backward:
            del call.weights[i]
        del p
        return y

    def _keep_for_next_call(self, call: "_Call", upto: int) -> None:
        """Forward: hold stages 0..upto (< ``min(k, L)``) in device memory for the next call (a live
        copy, or streamed)."""
        for c in range(min(upto + 1, call.num_first)):
            if c in call.next_call or self.resident[c]:
                continue
            if c in call.weights:
                call.next_call[c] = (self.host_params[c], call.weights[c])
            else:
                fetched: dict[int, Any] = {}
                self._fetch(fetched, c, "next", call.recorder)
                call.next_call[c] = (self.host_params[c], fetched[c])

    def _offload_activations(self, call: "_Call", i: int) -> None:
        """Stage ``i`` is dispatched: send its kept input (and saved residuals) to ``pinned_host``."""
        self.offloaded_activation_nbytes += tree_nbytes(call.acts[i]) + (
            tree_nbytes(call.saved[i]) if call.save else 0)
        call.acts[i] = jax.device_put(call.acts[i], self._act_host(call.sig.chain[i]))
        if call.save:
            call.saved[i] = jax.device_put(call.saved[i],
                                           [sh.with_memory_kind(HOST_KIND) for sh in call.residual_dev_sh[i]])
        call.offloaded[i] = True

    def _fetch_activations(self, call: "_Call", j: int) -> None:
        """Backward: bring stage ``j``'s offloaded input (and saved residuals) back to the device."""
        if call.offloaded[j]:
            call.acts[j] = jax.device_put(call.acts[j], self._act(call.sig.chain[j]))
            if call.save:
                call.saved[j] = jax.device_put(call.saved[j], call.residual_dev_sh[j])
            call.offloaded[j] = False

    def _first_cotangent(self, call: "_Call", loss_exe, cotangent, loss_args):
        """Pop the output from ``call.acts`` (which then holds the stage inputs), set ``call.grad`` to
        its cotangent (the loss's gradient, or the given one placed); returns the loss (or the output)."""
        sig = call.sig
        out = call.acts.pop()
        if cotangent is None:
            loss, grad = loss_exe(out, *loss_args)
            if self._batch_sh is not None:
                grad = jax.device_put(grad, self._act(split_diff(sig.chain[-1])[0]))
            first = loss
        else:
            given = split_diff(cotangent)[0] if aval_key(tree_aval(cotangent, "cotangent")) == \
                aval_key(sig.chain[-1]) else jax.tree_util.tree_leaves(cotangent)
            grad = jax.device_put(given, self._act(split_diff(sig.chain[-1])[0]), may_alias=False)
            first = out
        call.grad = grad
        return first

    def _stream_backward(self, call: "_Call", bwd: list, hyper, mode):
        """The backward: every stage in reverse, weights (and optimizer state, accumulated gradients,
        offloaded activations) fetched ``prefetch_depth`` stages ahead; records the step's results.
        Returns the parameter gradients per stage (``mode=None``), else ``None``."""
        n, k = self.num_stages, self.prefetch_depth
        call.host_grads = [None] * n if mode is None else None
        call.states = {} if mode == "update" else None
        call.accs = {} if mode is not None and self.grad_acc is not None else None
        call.new_acc, call.sumsq = [None] * n, [None] * n
        for j in range(n - 1, max(-1, n - 1 - k), -1):
            self._fetch(call.weights, j, "backward", call.recorder, call.states, call.accs)
            self._fetch_activations(call, j)
        for i in range(n - 1, -1, -1):
            self._backward_stage(call, bwd[i], i, hyper, mode)
        if mode == "update":
            self.step += 1
            self.grad_acc, self.micro_batches = None, 0
        elif mode == "accum":
            self.grad_acc, self.micro_batches = call.new_acc, self.micro_batches + 1
            self._sumsq = call.sumsq
        return call.host_grads

    def _backward_stage(self, call: "_Call", exe, i: int, hyper, mode) -> None:
        """Dispatch stage ``i``'s backward, send its results (gradients, accumulated gradients, or
        updated weights and moments) to where they live, fetch the stage ``prefetch_depth`` below."""
        k, recorder = self.prefetch_depth, call.recorder
        p = call.weights.pop(i)
        stage_input = call.acts[i]
        call.acts[i] = None
        ev = StageEvent("backward", i, "compute", recorder.now()) if recorder is not None else None
        args = (p, stage_input)
        if call.save:
            args += (call.saved[i],)
            call.saved[i] = None
        args += (call.grad,)
        if call.accs is not None:
            args += (call.accs.pop(i),)
        if mode == "update":
            args += (call.states.pop(i), hyper)
        res = exe(*args)
        del args, stage_input
        call.grad, results = res[0], res[1:]
        del res
        if recorder is not None:
            recorder.add(ev, call.grad)
        ev = StageEvent("backward", i, "d2h", recorder.now()) if recorder is not None else None
        on_device, moved = self._store_stage_results(call, i, p, results, mode)
        del results
        if recorder is not None:
            recorder.add(ev, moved)
        if self.throttle and call.prev_host is not None:
            jax.block_until_ready(call.prev_host)  # stage i+1's results are on the host
        if i - k >= 0:
            self._fetch(call.weights, i - k, "backward", recorder, call.states, call.accs)
            self._fetch_activations(call, i - k)
        self._record("backward", i)
        del p, on_device
        call.prev_host = moved

    def _store_stage_results(self, call: "_Call", i: int, p, results: tuple, mode):
        """Send stage ``i``'s backward results where they live: gradients (``mode=None``), accumulated
        gradients (``"accum"``) or updated weights and moments (``"update"``); keep stages 0..k for the
        next call. Returns ``(device-side results, what moves to the host)``."""
        keeps_next = call.next_call is not None and i <= self.prefetch_depth and not self.resident[i]
        if mode == "update":
            new_p, new_s = results
            self._track(results, i)
            self.host_params[i] = jax.device_put(new_p, self._host_sh[i])
            self.optimizer_state[i] = jax.device_put(new_s, self._state_host_sh[i])
            if keeps_next:
                call.next_call[i] = (self.host_params[i], new_p)  # the updated weights, already on the device
            return results, (self.host_params[i], self.optimizer_state[i])
        if keeps_next:  # not donated (see _run): the next call's forward starts with it
            call.next_call[i] = (self.host_params[i], p)
        if mode is None:
            (grads,) = results
            self._track(grads, i)
            host = jax.device_put(grads, self._diff_grad_sh[i])
            call.host_grads[i] = merge_diff(host, None, split_diff(self._param_avals[i])[2])
            return grads, host
        acc, call.sumsq[i] = results
        self._track(acc, i)
        call.new_acc[i] = moved = jax.device_put(acc, self._acc_host_sh[i])
        return acc, moved


@dataclasses.dataclass
class _Call:
    """What one ``forward`` / ``train_step`` call holds while it streams (stage -> device arrays)."""

    sig: Any
    recorder: Any
    save: bool                 # train_step keeps residuals beyond the stage input (remat other than True)
    offload: bool              # train_step offloads kept activations (offload_activations)
    num_first: int             # min(k, L): the stages fetched before the first compute
    next_call: dict | None     # stage -> (host_params it was copied from, device copy), for the next call
    weights: dict = dataclasses.field(default_factory=dict)  # stage -> its weights on the device
    states: dict | None = None  # stage -> its optimizer state on the device
    accs: dict | None = None    # stage -> its accumulated gradients on the device
    kept_for_backward: set = dataclasses.field(default_factory=set)
    acts: list | None = None   # train_step: stage i's input (on the device or offloaded)
    saved: list | None = None  # per stage, the residuals kept for its backward
    offloaded: list | None = None
    residual_dev_sh: list | None = None  # per stage, the device shardings of its saved residuals
    grad: Any = None           # the cotangent flowing backward
    prev_host: Any = None      # the previous stage's results moving to the host
    host_grads: list | None = None
    new_acc: list | None = None
    sumsq: list | None = None
