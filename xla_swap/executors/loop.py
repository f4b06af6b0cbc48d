"""The loop of a streaming runtime: a ``forward`` or ``train_step`` call executed stage by stage,
weights (and optimizer state, accumulated gradients, offloaded activations) fetched
``prefetch_depth`` stages ahead, results sent back to host memory.

Imports only jax (no torch).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .trace import StageEvent
from ._stages import HOST_KIND, _aval_key, _merge_diff, _split_diff, _tree_aval, tree_nbytes

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
            keep_w = [self.resident[i] or (self.prefetch_next_call and i <= k) for i in range(n)]
            has_acc = mode is not None and self.grad_acc is not None
            bwd = [self._exe(sig, "backward-saved" if save else "backward", i,
                             donate and (mode == "update" or not keep_w[i]), mode=mode, acc=has_acc)
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

    def _update_pass(self, hyper, coef, recorder) -> None:
        """Apply the optimizer to every stage from ``grad_acc`` (scaled by ``coef``), streaming weights,
        accumulated gradients and moments in ``prefetch_depth`` stages ahead, weights and moments out.

        Stages 0..k come from the weights the backward left in device memory (``prefetch_next_call``).
        """
        exes = self._update_exe_list()
        n, k = self.num_stages, self.prefetch_depth
        act = self.activation_sharding
        hyper_arr = jax.device_put(np.asarray(hyper, np.float32), act)
        coef_arr = jax.device_put(np.asarray(coef, np.float32), act)
        q, qs, qa = {}, {}, {}
        for j in range(min(k, n)):
            self._fetch(q, j, "update", recorder, qs, qa)
        prev = None
        for i in range(n):
            ev = StageEvent("update", i, "compute", recorder.now()) if recorder is not None else None
            new_p, new_s = exes[i](q.pop(i), qa.pop(i), qs.pop(i), hyper_arr, coef_arr)
            if recorder is not None:
                recorder.add(ev, new_p)
            self._track((new_p, new_s), i)
            self.host_params[i] = jax.device_put(new_p, self._host_sh[i])
            self.optimizer_state[i] = jax.device_put(new_s, self._state_host_sh[i])
            moved = (self.host_params[i], self.optimizer_state[i])
            del new_p, new_s
            if self.throttle and prev is not None:
                jax.block_until_ready(prev)  # stage i-1's results are on the host
            if i + k < n:
                self._fetch(q, i + k, "update", recorder, qs, qa)
            prev = moved
        self._carry = {}  # what the backward left is consumed (donated)
        self.grad_acc, self.micro_batches = None, 0
        self.step += 1

    def _fetch(self, q: dict, j: int, pass_name: str, recorder, qs: dict | None = None,
               qa: dict | None = None) -> None:
        """Start moving stage j's weights (and, into ``qs``, its optimizer state; into ``qa``, its
        accumulated gradients) to the device."""
        if qs is not None and self.optimizer is not None and j not in qs:
            qs[j] = jax.device_put(self.optimizer_state[j], self._state_dev_sh[j])
        if qa is not None and j not in qa:
            qa[j] = jax.device_put(self.grad_acc[j], self._acc_dev_sh[j])
        if j in q:
            return
        if self.resident[j]:
            q[j] = self.host_params[j]
            return
        carried = self._carry.pop(j, None)
        if carried is not None and carried[0] is self.host_params[j]:
            q[j] = carried[1]  # left in device memory by the previous call
            return
        ev = StageEvent(pass_name, j, "h2d", recorder.now()) if recorder is not None else None
        p = jax.device_put(self.host_params[j], self._dev_sh[j])
        self._track(p, j)
        q[j] = p
        if recorder is not None:
            recorder.add(ev, p)

    def _stream(self, sig, h, fwd, bwd, recorder, n, k, train, loss_exe, cotangent, loss_args, hyper, mode):
        throttle = self.throttle
        save = train and self.remat is not True
        opt = self.optimizer if mode == "update" else None
        offload = train and self.offload_activations
        res_dev = [list(e.output_shardings[1]) for e in fwd] if (offload and save) else None
        offloaded = [False] * n
        self.offloaded_activation_nbytes = 0
        saved: list = [None] * n
        x = jax.device_put(h, self._act(sig.chain[0]))
        # Forward. In training, the last k+1 stages stay for the start of the backward: once the
        # forward fetches nothing more, stage n-k-1's slot of the (k+1)-stage window would idle.
        keep = set(range(max(0, n - k - 1), n)) if train else set()
        q: dict[int, Any] = {}
        nc = min(k, n)
        for j in range(nc):
            self._fetch(q, j, "forward", recorder)
        # the next call's first stages, filled at this call's tail (cyclic schedule)
        nxt: dict[int, tuple[Any, Any]] | None = {} if self.prefetch_next_call else None

        def carry_next(upto: int) -> None:
            """Forward: hold stages 0..upto (< nc) in device memory for the next call (a live copy, or streamed)."""
            for c in range(min(upto + 1, nc)):
                if c in nxt or self.resident[c]:
                    continue
                if c in q:
                    nxt[c] = (self.host_params[c], q[c])
                else:
                    tmp: dict[int, Any] = {}
                    self._fetch(tmp, c, "next", recorder)
                    nxt[c] = (self.host_params[c], tmp[c])
        acts = [x] if train else None
        for i in range(n):
            p = q[i]
            ev = StageEvent("forward", i, "compute", recorder.now()) if recorder is not None else None
            if save:
                y, saved[i] = fwd[i](p, x)
            else:
                y = fwd[i](p, x)
            if recorder is not None:
                recorder.add(ev, y)
            if throttle:
                jax.block_until_ready(x)  # stage i-1 done: its weights' memory is free
            if i + k < n:
                self._fetch(q, i + k, "forward", recorder)
            elif nxt is not None and not train:
                carry_next(i + k - n)
            if offload and i not in keep:  # stage i is dispatched: its kept input (and residuals) go to the host
                self.offloaded_activation_nbytes += tree_nbytes(acts[i]) + (tree_nbytes(saved[i]) if save else 0)
                acts[i] = jax.device_put(acts[i], self._act_host(sig.chain[i]))
                if save:
                    saved[i] = jax.device_put(saved[i], [sh.with_memory_kind(HOST_KIND) for sh in res_dev[i]])
                offloaded[i] = True
            self._record("forward", i)
            if i not in keep:
                del q[i]
            del p
            x = y
            if train:
                acts.append(y)
        self._carry = {}  # whatever the forward did not take is stale
        if not train:
            if nxt is not None:
                self._carry = nxt
            return (x,)

        out = acts.pop()  # acts[i] is now the input of stage i
        if cotangent is None:
            loss, g = loss_exe(out, *loss_args)
            if self._batch_sh is not None:
                g = jax.device_put(g, self._act(_split_diff(sig.chain[-1])[0]))
            first = loss
        else:
            cd = _split_diff(cotangent)[0] if _aval_key(_tree_aval(cotangent, "cotangent")) == \
                _aval_key(sig.chain[-1]) else jax.tree_util.tree_leaves(cotangent)
            g = jax.device_put(cd, self._act(_split_diff(sig.chain[-1])[0]), may_alias=False)
            first = out
        del out
        host_grads: list | None = [None] * n if mode is None else None
        qs: dict[int, Any] | None = {} if mode == "update" else None
        qa: dict[int, Any] | None = {} if mode is not None and self.grad_acc is not None else None
        new_acc: list = [None] * n
        sumsq: list = [None] * n
        prev_host = None
        def fetch_acts(j):
            if offloaded[j]:
                acts[j] = jax.device_put(acts[j], self._act(sig.chain[j]))
                if save:
                    saved[j] = jax.device_put(saved[j], res_dev[j])
                offloaded[j] = False

        for j in range(n - 1, max(-1, n - 1 - k), -1):
            self._fetch(q, j, "backward", recorder, qs, qa)
            fetch_acts(j)
        for i in range(n - 1, -1, -1):
            p = q.pop(i)
            xi = acts[i]
            acts[i] = None
            ev = StageEvent("backward", i, "compute", recorder.now()) if recorder is not None else None
            args = (p, xi)
            if save:
                args += (saved[i],)
                saved[i] = None
            args += (g,)
            if qa is not None:
                args += (qa.pop(i),)
            if mode == "update":
                args += (qs.pop(i), hyper)
            res = bwd[i](*args)
            del args, xi
            if mode is None:
                g, dp = res
            elif mode == "accum":
                g, acc_i, sumsq[i] = res
            else:
                g, new_p, new_s = res
            del res
            if recorder is not None:
                recorder.add(ev, g)
            ev = StageEvent("backward", i, "d2h", recorder.now()) if recorder is not None else None
            if mode != "update":
                if nxt is not None and i <= k and not self.resident[i]:  # stages 0..k: kept for the next call
                    nxt[i] = (self.host_params[i], p)  # not donated (keep_w): the next call's forward starts with it
                if mode is None:
                    self._track(dp, i)
                    hg = jax.device_put(dp, self._diff_grad_sh[i])
                    host_grads[i] = _merge_diff(hg, None, _split_diff(self._param_avals[i])[2])
                    moved = hg
                else:
                    dp = acc_i
                    self._track(dp, i)
                    new_acc[i] = moved = jax.device_put(acc_i, self._acc_host_sh[i])
                    del acc_i
            else:
                dp = (new_p, new_s)  # the device-side results, alive until this stage is recorded
                self._track(dp, i)
                self.host_params[i] = jax.device_put(new_p, self._host_sh[i])
                self.optimizer_state[i] = jax.device_put(new_s, self._state_host_sh[i])
                if nxt is not None and i <= k and not self.resident[i]:
                    nxt[i] = (self.host_params[i], new_p)  # the updated weights, already on the device
                moved = (self.host_params[i], self.optimizer_state[i])
                del new_p, new_s
            if recorder is not None:
                recorder.add(ev, moved)
            if throttle and prev_host is not None:
                jax.block_until_ready(prev_host)  # stage i+1's results are on the host
            if i - k >= 0:
                self._fetch(q, i - k, "backward", recorder, qs, qa)
                fetch_acts(i - k)
            self._record("backward", i)
            del p, dp
            prev_host = moved
        if mode == "update":
            self.step += 1
            self.grad_acc, self.micro_batches = None, 0
        elif mode == "accum":
            self.grad_acc, self.micro_batches = new_acc, self.micro_batches + 1
            self._sumsq = sumsq
        if nxt is not None:
            self._carry = nxt
        gx = _merge_diff(g, None, _split_diff(sig.in_aval)[2])
        return first, gx, host_grads
