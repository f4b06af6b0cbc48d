"""Offload planner: choose an :class:`OffloadPolicy` for a layered model under a device-memory budget.

Framework-neutral and dependency-free: pure Python, imports neither torch, torch_xla nor jax.

Units everywhere: **bytes** for sizes, **seconds** for times, **GB/s = 1e9 bytes/s** for link
bandwidths (the unit of ``docs/measured.md``); GiB (2**30 bytes) appears only in messages.

How it works
------------
1. The caller describes one layer (or each layer) with a :class:`LayerCost` (bytes of weights,
   gradients, optimizer state, saved activations, carry; forward compute time), the number of
   layers, the device-memory budget and the host link (:class:`Link`).
2. :func:`evaluate` predicts, for one policy, the peak device bytes (memory model below, for a
   compiler ``target``: an accelerator by default, or XLA:CPU) and the step time (time model
   below).
3. :func:`plan` enumerates the small discrete policy space and returns the :class:`Plan` with the
   lowest predicted step time whose predicted device bytes fit the budget, or raises
   :class:`InfeasibleBudgetError` carrying the exact minimum feasible budget.

Memory model (peak device bytes of a policy; ``L`` layers, prefetch depth ``k``)
------------------------------------------------------------------------------
A conservative sum, phases distinguished only between fwd/bwd and the optimizer step
(cf. the SwapAdvisor and ZeRO-Offload memory accounting: everything resident + what is in
flight).  Forward+backward phase, with ``target="accelerator"`` (the default: XLA:GPU / XLA:TPU,
whose host offloader turns the placement annotations into copies; see "Target" below for
XLA:CPU):

* ``params``: all ``L`` layers if ``"device"``; if ``"host"``, a window of the ``k+1`` largest
  layers (the layer being computed plus ``k`` prefetched - the double buffer of docs/measured.md's
  streaming runs when ``k = 1``): the size of the streaming schedule's live set,
  ``PrefetchSchedule.max_live_stages`` (:mod:`xla_swap.planning.prefetch`, ``min(k+1, L)``), the
  schedule the runtime runs; its layers' copies in the time model below come from it too.
* ``grads`` (training): all ``L`` layers if ``"device"``; if ``"host"``, the in-flight gradient
  of one layer (the largest).
* ``optimizer_state`` (training): all ``L`` layers if ``"device"``, else nothing in this phase.
* saved activations (training): for every layer, each named activation placed ``"device"``,
  plus the untagged intermediates (``intermediate_bytes``) unless ``remat``; named activations
  placed ``"host"`` are prefetched back for the backward pass with the weights: a window of the
  ``k+1`` largest layers; ``"remat"`` ones are not saved (see ``recompute``).
* saved layer inputs (training): every layer's input (its carry) stays on the device - it is the
  residual the backward needs, and the checkpoint that ``remat`` restarts from.
* ``recompute`` (training): the layer being back-propagated holds what it recomputes beside its
  gradient working set - ``intermediate_bytes`` if ``remat``, plus its named activations placed
  ``"remat"`` (the largest layer's sum).  This is the per-segment term of the checkpointing cost
  in Chen, Xu, Zhang and Guestrin, "Training Deep Nets with Sublinear Memory Cost" (arXiv
  1604.06174, 2016, sec. 4): memory = the stored checkpoints (here the saved layer inputs) plus
  the forward-backward working memory of the one segment (here one layer) being recomputed.
  Without recomputation the intermediates are already counted once per layer as saved
  activations, so nothing is added.  It also bounds the forward, where the layer being computed
  holds the same intermediates as transients.
* ``working set``: the largest layer's ``working_bytes`` - what a layer holds while it computes
  beyond the intermediates counted above (saved or recomputed): in the backward its gradients in
  flight, in inference its forward transients.  The default, ``sum(activations) +
  intermediate_bytes``, is an upper bound (the gradient of every saved tensor has that tensor's
  shape); a model that derives its own value says so (e.g. ``examples/train_decoder.py``).
* ``carry``: the live carry (in the backward, the gradient of the carry).

Optimizer phase (training): the same ``params`` / ``grads`` / ``optimizer_state`` residency, with
host-placed ones streamed through a window of ``k+1`` layers; no activations.  Peak = max of the
two phases.  Inference (``training=False``) has no grads, optimizer state, saved activations or
recompute.

Target: what the compiler does with the placement (``target=`` of evaluate / plan / min_feasible_bytes)
------------------------------------------------------------------------------------------------
``"accelerator"`` (default) is the model above.  ``"xla_cpu"`` describes XLA:CPU (jaxlib 0.10.2;
facts from the compiled HLO and buffer assignment of ``benchmarks/planner_vs_pjrt.py``, reproduce
with ``XLA_FLAGS=--xla_dump_to=DIR``), where the placement does not create device copies:

* XLA:CPU has no host offloader: its pass ``strip-memory-placement-annotations`` (pipeline
  ``pre-spmd-partitioner``) deletes every ``annotate_device_placement`` custom call, and there is
  no memory-space assignment and no async copy (``copy-start``/``copy-done``).  Entry parameters
  and results placed in ``pinned_host`` keep ``S(5)`` in the entry layout and stay in host
  memory (host bytes as on an accelerator), but nothing is prefetched or kept in flight: the
  ``k+1``-layer window of host-placed weights and the in-flight gradient of host-placed
  gradients are 0, replaced by the one layer's ``operand copies`` below; the optimizer phase
  streams one layer instead of ``k+1`` (not measured: the compared step has no optimizer).
* Named activations placed ``"host"`` keep their device copy (the annotations that would move them
  are stripped): they count as ``"device"``.  Derived from the pass, not measured (the
  comparison uses no such policy).
* ``operand copies``: every dynamic slice of a stacked per-layer buffer that a layer's dots read is
  materialised as a device temporary (a ``dynamic-slice`` fusion writing the dot's dense
  operand), whichever memory the stack lives in: the layer's weight slices - or, at the end of
  its backward, its weight-gradient slices before the ``dynamic-update-slice`` into the stacked
  gradient - at most ``max(param_bytes, grad_bytes)`` of one layer; and in training the slice of
  its saved input (``carry_bytes``) and, unless ``remat``, of its saved intermediates
  (``intermediate_bytes`` and the named activations saved on the device).  Measured at the
  backward's peak (example ``Config()``): 3 of the 4 weight matrices of the layer (524,288 of
  787,456 bytes) and its saved input; without remat also 4,980,736 bytes of slices of its
  5,771,264 bytes of saved intermediates and input (the rest is copied later in its backward).

The memory model changes with ``target``; the time model does not (on XLA:CPU nothing crosses a
link: evaluate with any :class:`Link`, its step times describe an accelerator).

Time model (predicted step time)
--------------------------------
A streaming schedule like FlexGen's overlapped block schedule (Sheng et al., "FlexGen:
High-Throughput Generative Inference of LLMs with a Single GPU", ICML 2023, sec. 4.2 cost model)
and SwapAdvisor's swap scheduling (Huang, Chen and Wang, "SwapAdvisor", ASPLOS 2020): each phase runs its layers in order
on one compute stream while one host-to-device and one device-to-host copy queue move the bytes of
that layer; a layer's inbound copy may run up to ``k`` layers ahead (it waits for the buffer of
layer ``j-k-1`` to be released), the layer computes once its inputs arrived, and its outbound copy
starts when it finished.  Once the pipeline runs, the per-layer time is ``max(compute_i,
transfer_i)``; what is exposed at the ends depends on what a call starts with (next section,
"Steady state"): in a loop of calls (the default) the first layers' weights are already on the
device and only the last layer's outbound copy is exposed; in a single cold call the first layer's
prefetch is exposed too.  ``transfer_i = max(in/h2d, out/d2h, (in+out)/both)``: when both
directions move in one phase each gets its share of the both-at-once bandwidth (docs/measured.md:
54-55 GB/s each way, ~93 GB/s together, pinned, on an H200).

* forward: compute ``f_i``; in: the layer's weights if params are on host (in the steady state not
  for the first ``k`` layers - ``k+1`` in training - which the previous call left on the device);
  out: its host-placed named activations (training).
* backward (training, layers in reverse): compute ``backward_factor * f_i`` (2 by default: the
  usual ``6 N D`` accounting - 2ND forward, 4ND backward - of Kaplan et al. 2020, "Scaling Laws for
  Neural Language Models", sec. 2.1) plus recompute: ``remat`` adds one more forward (8ND, the
  "hardware FLOPs" of Chowdhery et al. 2022, PaLM, appendix B), a named ``"remat"`` activation adds
  its ``recompute_s`` (capped at one forward); in: weights (not for the last ``min(k, L)`` layers,
  the first of the backward, still resident from the forward, as ``StreamingRuntime`` keeps them
  across the turn) + host-placed activations; out: the gradient if grads are on host
  (ZeRO-Offload, Ren et al., USENIX ATC 2021: gradients stream to host memory as the backward produces them).
* optimizer step (training): the update runs on the device layer by layer, in the backward's order
  (layer 0 last): in: host-placed params + grads + optimizer state; out: host-placed params +
  optimizer state; compute: ``optimizer_s`` (0 unless given; the update is memory-bound and small).

Step time = sum of the phases (optimizer state on the device: mode ``"device"``).

Steady state (``steady_state=True`` of evaluate / plan, the default; ``Plan.steady_state``)
------------------------------------------------------------------------------------------
Step times are those of one call in a loop of calls: the steady state of ``StreamingRuntime``'s
cyclic schedule across calls (``prefetch_next_call=True``, its default).  With params on host a
call starts with its first layers' weights on the device, so it computes at once, and its last
pass streams the next call's first layers after its last row (rows without compute; each copy
waits, as any, for the buffer of the row ``k+1`` rows earlier):

* inference: the forward starts with layers ``0..k-1`` and streams them again for the next call
  at its tail.  ``L`` layers of weights still cross per call, but the fill of the pipeline is
  hidden: with uniform layers the forward takes ``max(L*c, L*x)``, its floor.  With ``k >= L``
  nothing moves (the runtime keeps every layer: a live copy).
* training, modes ``"streamed"`` and ``"device"``: a step's last pass (the backward, or the
  ``"device"`` mode's optimizer phase, both in the order ``L-1..0``) keeps the updated weights of
  layers ``0..k`` (layer ``k`` in its window's free slot, the slot of a layer ``-1``), so the next
  forward starts with layers ``0..k`` and streams ``L - k - 1``; the first of them waits for layer
  0 to free its slot of the ``k+1``-layer window.  With the last ``k+1`` kept at the
  forward->backward turn, the backward streams ``L - k - 1``: ``2L - 2k - 2`` layers of weights in
  per step (nothing when ``k + 1 >= L``); the ``"device"``
  mode's optimizer phase moves its own ``L`` in and out.  ``StreamingRuntime.train_step``
  without an optimizer keeps the streamed weights its backward used: the bytes of the
  ``"streamed"`` mode with ``optimizer_bytes=0`` (new weights out instead of gradients).
* training, mode ``"host"``: no carry: the CPU rewrites the weights after the backward, layer 0
  last, so the next forward copies all ``L`` in (``2L - k - 1`` per step) once layer 0 is updated -
  the single-call time.

Each call is simulated from an idle link, so its last outbound copy stays exposed (in a loop it
overlaps the next call's start: the prediction errs high by up to that copy).  The floors count
the bytes of the simulation they bound.  ``steady_state=False`` times a single, cold call (the first
of a loop, or ``prefetch_next_call=False``): every weight the call uses streams in during it, the
first prefetch is exposed (uniform layers, inference: ``max(x + L*c, L*x + c)``), and a training
step moves ``2L - k - 1`` layers of weights in.  The memory model is the same for both.  Measured
(benchmarks/results/torch_stack_cyclic/README.md, H100, 8 bf16 layers D=8192 F=32768, 8192 tokens,
k=2, link 54.5 / 54.6 / 79.3 GB/s, on-device compute 95.3 ms forward, 250.9 ms backward, 18.8 ms
AdamW; the runtime measured there kept layers ``0..k-1`` and streamed layer ``k`` at the start of
the next forward and kept the last ``k`` at the turn: two layers more per step than today's schedule): forward predicted 157.6 ms (= the floor) against 155.9 ms
measured in a loop (cold: 169.5 ms against 171.1 ms with ``prefetch_next_call=False``); training
step without optimizer 0.393 s against 0.395 s (cold: 0.440 s against 0.419 s); AdamW step with
bf16 moments streamed 0.798 s against 0.753 s (floor 0.704 s: ``2L - 2k`` layers of weights + ``L``
of moments in, ``L`` of weights and moments out, at the both-ways bandwidth).

Optimizer modes (``optimizer_state="host"``; :data:`OPTIMIZER_MODES`, ``Plan.optimizer_mode``)
----------------------------------------------------------------------------------------------
With the state in host memory the planner times two ways to run the step and keeps the faster
(``evaluate`` / ``plan`` ``optimizer_mode=`` forces one).  Both simulate the whole step as one
stream (forward rows, then backward rows; the backward's first copies may overlap the forward's
tail), keep the last ``k`` layers' weights resident across the turn as ``StreamingRuntime`` does
(``2L - 2k - 2`` layers of weights in per step in the steady state of ``"streamed"``, ``2L - k - 1`` in a
single call and in ``"host"``: section "Steady state"), and share the link as copies overlap (a copy
alone gets its direction's full bandwidth; copies in both directions split ``both_gbps``):

* ``"streamed"`` (``StreamingRuntime(optimizer=AdamW, optimizer_state_on_host=True)``): per layer,
  in the backward: in = weights + ``optimizer_bytes`` (the moments); out = new weights + moments;
  compute = backward + recompute + ``optimizer_s`` (the update on the device).  Gradients never
  leave the device.  Bounded by PCIe bytes / bandwidth and device compute.
* ``"host"`` (ZeRO-Offload, Ren et al. 2021; FSDP2 ``CPUOffloadPolicy``): the backward sends each
  layer's gradient out (D2H); the CPU then updates the layer in host memory in
  ``LayerCost.host_update_bytes / Link.host_memory_gbps`` seconds (AdamW reads param + grad + m + v
  and writes param + m + v: 14 bytes per bf16 parameter), one layer at a time.  With
  ``host_overlap=True`` (ZeRO-Offload) a layer's update starts once its gradient arrived, so the
  step is about max(backward, host update) plus the last layer's update; with ``False`` (FSDP2)
  the updates follow the whole backward.  Host memory bandwidth is the third resource.

Their floor is ``max(device compute, PCIe bytes / bandwidth, host update bytes / host memory
bandwidth)``.  Calibration: at the default shape of benchmarks/results/torch_stack/README.md
(H100, 8 bf16 layers D=8192 F=32768, bf16 moments, k=2, 0.359 s of device compute) the streamed
mode predicts 0.865 s for a single call (``steady_state=False``) against 0.831 s measured with each
call on its own, before the cyclic schedule; in a loop (the steady state, section "Steady state")
0.798 s against 0.753 s (benchmarks/results/torch_stack_cyclic); the host mode's CPU update alone, 14 bytes x
4.29e9 parameters / 21.2 GB/s = 2.84 s, against 2.62 s for FSDP2's ``AdamW(foreach=True)`` on 16
cores (docs/measured.md, 8b).  The memory model does not tell the
modes apart: it keeps the optimizer-phase window of ``k+1`` layers of params + grads + state.

Step time of the ``"device"`` mode = sum of the phases.  Floor = ``max(total compute, total in / h2d, total out / d2h,
(total in + out) / both)`` - the best any schedule could do for that policy's traffic
(docs/measured.md's "floor = max(compute, 8 GiB / 54 GB/s)").

Search and the order in which shrinking budgets move things to the host
---------------------------------------------------------------------
Policy space: ``params x grads x optimizer_state x {device, host, remat}^(named activations)
x remat x prefetch_depth in 1..max_prefetch_depth``, restricted by two structural rules:

1. ``grads="host"`` requires ``params="host"`` (OffloadPolicy: gradient placement is only
   meaningful for swapped parameters);
2. ``optimizer_state="host"`` requires ``grads="host"`` (ZeRO-Offload's partition: the optimizer
   state and its update go with the gradients; the update consumes one layer's gradient and state
   together).

``plan`` picks the minimum predicted step time; ties (within 1e-9 relative) go to fewer host
bytes, then the simpler policy (fewer non-default choices, smaller prefetch depth), then fewer
device bytes, then enumeration order - fully deterministic.  The planner re-optimises from
scratch at every budget, so predicted step time never decreases as the budget shrinks.

**Order claimed (asserted by tests/planning/test_planner.py).** In training, as the budget shrinks below
the all-device footprint, the component classes first leave the device in this order:

1. **saved activations** - named activations go to the host (offload) while the copy hides
   behind compute, then to ``"remat"``; untagged intermediates (``remat=True``) join them here or
   just after the parameters, whichever the cost model finds cheaper at that budget (recomputing
   frees ``L - 1`` layers' saved bytes, not ``L``: the layer being back-propagated holds them
   again, the ``recompute`` term);
2. **parameters** (``params="host"``): in training a swapped weight crosses the link up to four times
   per step (in for the forward, in for the backward, in and out for the optimizer step, which has
   no compute to hide behind; the first and the last ``k`` layers skip an inbound copy, kept on the
   device - steady state - so a deeper prefetch saves traffic and the planner deepens it while its
   window fits),
   while an offloaded activation crosses twice, hidden behind the forward and backward compute, and
   a recompute costs a fraction of one forward;
3. **gradients** (``grads="host"``) - after parameters by rule 1;
4. **optimizer state** (``optimizer_state="host"``) - after gradients by rule 2; it is the
   costliest (its bytes round-trip through the optimizer step) but frees the most (Adam: 4x the
   bf16 weights), so once it moves, activations may return to the device.

Steps 3 and 4 are structural and hold for every input (rules 1-2) *among the classes that leave
before the optimizer state*; but when the streamed optimizer mode hides a layer's weights and state
behind its backward compute (a compute-bound stack such as the small BERT-like stack of the tests),
parameters, gradients and optimizer state leave the device together, first, and activations after;
 1-before-2 is the cost model's verdict
whenever offloading or recomputing a layer's activations costs less than its weights' round trips
- true for the docs/measured.md stack and the small BERT-like stack of the tests; a stack where it is not
(e.g. huge activations on a slow link) gets parameters first.  A smaller budget may bring an
earlier class back to the device when a later move frees more.  In inference only the parameters
(and the prefetch depth) are placed: parameters are the only class that moves.

Several devices (``num_devices=`` of evaluate / plan / min_feasible_bytes; ``Plan.num_devices``)
--------------------------------------------------------------------------------------------------
A stack spread over ``n`` devices, FSDP-style or tensor-parallel, as ``SwappedStack`` /
``StreamingRuntime`` run it with a mesh: every layer's weights, gradients and optimizer state are
sharded over all ``n`` devices and each device's shard lives in the host memory attached to it, so
each device holds and moves ``1/n`` of them.  The planner models **one device**: it divides each
layer's ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` and ``host_update_bytes`` by ``n``
(rounded up: the largest shard) and leaves everything else as given.  So:

* every other :class:`LayerCost` field is **per device, as the caller gives it**: the compute time
  (``forward_s`` or ``flops / flops_per_s``, ``optimizer_s``, ``recompute_s``) and the activation
  bytes (``activations``, ``intermediate_bytes``, ``carry_bytes``, ``working_bytes``).  With FSDP
  plus data parallelism (the batch split over the devices) or tensor parallelism they are about
  ``1/n`` of the one-device figures: pass the per-device values (e.g. the one-device ones divided by
  ``n``).  The planner does not divide them: how the tokens and the activations split depends on the
  sharding (a tensor-parallel layer keeps its replicated carry whole).
* :class:`Link` is **per device**: each GPU has its own PCIe link (docs/measured.md section 7: 54.4 GB/s per
  GPU, 108.8 aggregate on 2 H200s).  ``host_memory_gbps`` is the host memory bandwidth one device's
  CPU update gets: where ``n`` devices share one host, pass the host's figure divided by ``n``.
* the collectives (FSDP's all-gather and reduce-scatter, tensor parallelism's all-reduces) are not
  in the time model; where they matter, add their time to the per-device compute.
* every reported byte (``Plan.device_bytes``, ``host_bytes``, the components, ``min_budget_bytes``,
  ``budget_bytes``) and every time is **per device**; the budget is one device's memory.

``num_devices=1`` (the default) is the one-device model, unchanged.

Errors: invalid inputs raise ``ValueError`` / ``TypeError`` naming the field; an unreachable
budget raises :class:`InfeasibleBudgetError` (a ``ValueError``).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from typing import Iterable, Mapping, Sequence

from xla_swap.planning.policy import FrozenMapping, OffloadPolicy
from xla_swap.planning.prefetch import PrefetchSchedule

__all__ = [
    "GB", "GiB", "Link", "H200_PINNED", "LayerCost", "Plan", "InfeasibleBudgetError",
    "adam_state_bytes", "evaluate", "plan", "min_feasible_bytes", "TARGETS", "OPTIMIZER_MODES",
    "HOST_MEMORY_GBPS",
]

#: Bytes per GB (link bandwidths are in GB/s, as in docs/measured.md).
GB = 1_000_000_000
#: Bytes per GiB (used in messages and tables only).
GiB = 1 << 30

#: Compilers the memory model describes (module docstring, "Target"): ``"accelerator"`` - XLA:GPU /
#: XLA:TPU, whose host offloader turns placement annotations into copies (the default) - and
#: ``"xla_cpu"`` - XLA:CPU, which strips the annotations and materialises per-layer slices.
TARGETS = ("accelerator", "xla_cpu")

#: Where and how the optimizer step runs (module docstring, "Optimizer modes"): ``"device"`` - the
#: state lives in device memory (``OffloadPolicy.optimizer_state="device"``); ``"streamed"`` - the
#: state lives in host memory and each layer's state crosses PCIe in the backward, the update runs
#: on the device right after the layer's backward (``StreamingRuntime(optimizer=...,
#: optimizer_state_on_host=True)``); ``"host"`` - the gradients go to host memory and the update runs
#: on the CPU, bounded by host memory bandwidth (ZeRO-Offload / FSDP2 ``CPUOffloadPolicy``).
OPTIMIZER_MODES = ("device", "streamed", "host")

#: Host memory bandwidth in GB/s (1e9 bytes/s) of the GPU host: a 2 GiB bf16 ``copy_`` moved
#: 21.2 GB/s (docs/measured.md, section 7, the FSDP2 anchor on the H100 machine).  Used as the
#: bytes *touched* (read + written) per second by a CPU optimizer update: with it the model gives
#: 14 bytes/parameter x 4.29e9 parameters / 21.2 GB/s = 2.84 s for the default stack's AdamW, against
#: 2.62 s measured for ``torch.optim.AdamW(foreach=True)`` on 16 cores (docs/measured.md, 8b).
HOST_MEMORY_GBPS = 21.2

#: Largest number of layers the model accepts (the search simulates every layer).
MAX_LAYERS = 10_000

#: Maximum number of named activations the exhaustive search enumerates (3**6 placements).
MAX_NAMED_ACTIVATIONS = 6
_REL_TIE = 1e-9


# --------------------------------------------------------------------------- validation helpers

#: Largest byte count accepted anywhere (2**63 - 1, what an int64 byte counter holds): larger
#: values are typos, and would overflow the float arithmetic of the time model.
MAX_BYTES = (1 << 63) - 1


def _as_bytes(owner: str, field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}.{field} must be a non-negative integer number of bytes, got {value!r}")
    if isinstance(value, numbers.Integral):
        value = int(value)
    else:
        try:
            value = float(value)
        except OverflowError:
            raise ValueError(f"{owner}.{field} must be <= 2**63 - 1 bytes, got {value!r}") from None
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{owner}.{field} must be a whole number of bytes, got {value!r}")
        value = int(value)
    if value < 0:
        raise ValueError(f"{owner}.{field} must be >= 0 bytes, got {value}")
    if value > MAX_BYTES:
        raise ValueError(f"{owner}.{field} must be <= 2**63 - 1 bytes, got a number with {len(str(value))} digits")
    return value


def _as_float(owner: str, field: str, value, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}.{field} must be a real number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        raise ValueError(f"{owner}.{field} must be finite and {need}, got {value!r}")
    return value


def _amount(owner: str, field: str, value) -> float:
    """``value`` as a finite number >= 0 (an int or float in range passes as it is: the planner's hot path)."""
    if type(value) in (int, float) and 0 <= value <= MAX_BYTES:
        return value
    return _as_float(owner, field, value, positive=False)


def _from_dict(cls, data: Mapping):
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__}.from_dict expects a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(map(repr, unknown))}; "
                         f"known fields: {', '.join(sorted(known))}")
    return cls(**data)


def _gib(n: float) -> str:
    return f"{n / GiB:.3f} GiB"


# --------------------------------------------------------------------------- inputs

@dataclasses.dataclass(frozen=True)
class Link:
    """Host <-> device link bandwidths of **one device**, in GB/s (1e9 bytes/s).

    Per device: with ``num_devices > 1`` each device has its own link (its own PCIe link to the
    host memory attached to it) and moves its own shard over it; ``host_memory_gbps`` is the host
    memory bandwidth one device's CPU update gets (module docstring, "Several devices").

    Args:
      h2d_gbps: host-to-device bandwidth when only that direction moves.
      d2h_gbps: device-to-host bandwidth when only that direction moves.
      both_gbps: aggregate bandwidth (sum of both directions) when both move at once; ``None``
        means full duplex (``h2d_gbps + d2h_gbps``).  docs/measured.md measured ~93 GB/s on an H200,
        not 2 x 54.
      host_memory_gbps: host memory bandwidth in GB/s: the bytes a CPU optimizer update reads
        plus writes per second (the third resource, beside PCIe and device compute, of the
        ``"host"`` optimizer mode).  Default :data:`HOST_MEMORY_GBPS` = 21.2 GB/s, the bf16 copy
        measured on the H100 host (docs/measured.md, section 7).

    Raises:
      TypeError / ValueError: a bandwidth is not a finite number > 0 (the message names it).
    """

    h2d_gbps: float
    d2h_gbps: float
    both_gbps: float | None = None
    host_memory_gbps: float = HOST_MEMORY_GBPS

    def __post_init__(self):
        object.__setattr__(self, "host_memory_gbps",
                           _as_float("Link", "host_memory_gbps", self.host_memory_gbps, positive=True))
        for name in ("h2d_gbps", "d2h_gbps"):
            object.__setattr__(self, name, _as_float("Link", name, getattr(self, name), positive=True))
        if self.both_gbps is None:  # full duplex: the error, if any, is about the two fields given
            both = self.h2d_gbps + self.d2h_gbps
            if not math.isfinite(both):
                raise ValueError(f"Link.h2d_gbps + Link.d2h_gbps (the default both_gbps) must be finite, got "
                                 f"{self.h2d_gbps!r} + {self.d2h_gbps!r}")
        else:
            both = _as_float("Link", "both_gbps", self.both_gbps, positive=True)
        object.__setattr__(self, "both_gbps", both)

    @classmethod
    def from_dict(cls, data: Mapping) -> "Link":
        """Build from a mapping; unknown keys raise ``ValueError`` naming them."""
        return _from_dict(cls, data)

    def transfer_s(self, in_bytes: float, out_bytes: float) -> float:
        """Seconds to move ``in_bytes`` host->device and ``out_bytes`` device->host together:
        ``max(in/h2d, out/d2h, (in+out)/both)`` (0 when nothing moves).

        Raises: TypeError / ValueError: a byte count is not a finite real number >= 0 (named).
        """
        in_bytes = _amount("Link.transfer_s", "in_bytes", in_bytes)
        out_bytes = _amount("Link.transfer_s", "out_bytes", out_bytes)
        t = max(in_bytes / (self.h2d_gbps * GB), out_bytes / (self.d2h_gbps * GB))
        if in_bytes and out_bytes:
            t = max(t, (in_bytes + out_bytes) / (self.both_gbps * GB))
        return t

    def host_update_s(self, touched_bytes: float) -> float:
        """Seconds for a CPU optimizer update that reads plus writes ``touched_bytes`` bytes of host
        memory: ``touched_bytes / host_memory_gbps`` (the update is memory-bound).

        Raises: TypeError / ValueError: ``touched_bytes`` is not a finite real number >= 0.
        """
        touched_bytes = _amount("Link.host_update_s", "touched_bytes", touched_bytes)
        return touched_bytes / (self.host_memory_gbps * GB)


#: Pinned host memory on an NVIDIA H200 (docs/measured.md, measured 2026-11-22): 54 GB/s each way,
#: ~93 GB/s both at once.
H200_PINNED = Link(h2d_gbps=54.0, d2h_gbps=54.0, both_gbps=93.0)


def adam_state_bytes(num_params: int, state_dtype_bytes: int = 4) -> int:
    """Bytes of Adam state for ``num_params`` parameters: two moments (m, v) of
    ``state_dtype_bytes`` each (fp32 by default: 8 bytes/parameter, i.e. 2x the fp32 params,
    4x bf16 params).  Raises ``ValueError`` / ``TypeError`` for negative or non-integer input."""
    n = _as_bytes("adam_state_bytes", "num_params", num_params)
    return 2 * n * _as_bytes("adam_state_bytes", "state_dtype_bytes", state_dtype_bytes)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """Costs of one layer of a layered (scanned) model.  Sizes in bytes, times in seconds.

    Args:
      param_bytes: the layer's weights.
      grad_bytes: its weight gradients (training); ``None`` means ``param_bytes``.
      optimizer_bytes: its optimizer state (e.g. Adam: two fp32 moments, see
        :func:`adam_state_bytes`); 0 for none.
      activations: ``{name: bytes}`` of the named activations (``offload_name(t, name)``) the
        layer saves for its backward pass.
      intermediate_bytes: the untagged intermediates the layer saves for backward when not
        rematerialised, and recomputes in its backward when ``remat`` (excluding the layer
        input, counted via ``carry_bytes``).
      carry_bytes: the layer's input (= output) activation, the scan carry.
      working_bytes: what the layer holds while it computes beyond its intermediates (which the
        memory model counts as saved or, under recomputation, as ``recompute``): in the backward
        its gradients in flight, in inference its forward transients.  ``None`` means
        ``sum(activations) + intermediate_bytes``, an upper bound (the gradient of every saved
        tensor has that tensor's shape).
      forward_s: measured forward time of the layer, seconds.  Or instead give
      flops: the layer's forward FLOPs (e.g. ``2 * params * tokens``) and
      flops_per_s: the achieved FLOP/s; forward time = ``flops / flops_per_s``.
      backward_factor: backward time / forward time; 2.0 by default (the usual ``6 N D``
        accounting: 2ND forward + 4ND backward, Kaplan et al. 2020).
      recompute_s: ``{name: seconds}`` to recompute a named activation placed ``"remat"``;
        by default its share of the saved bytes times ``forward_s`` (a heuristic).
        ``remat=True`` always costs one full forward.
      optimizer_s: time of the layer's optimizer update on the device, seconds (default 0); in
        the ``"streamed"`` optimizer mode it runs right after the layer's backward.
      host_update_bytes: bytes of host memory the layer's optimizer update reads plus writes
        when it runs on the CPU (the ``"host"`` optimizer mode).  ``None`` (default) means
        ``2 * param_bytes + grad_bytes + 2 * optimizer_bytes``: AdamW reads the weights, the
        gradient and both moments and writes the weights and both moments, each in its own dtype
        (14 bytes per bf16 parameter with bf16 moments; docs/measured.md, section 7).  Give it
        for other layouts, e.g. fp32 master weights beside bf16 device weights.

    Raises:
      TypeError / ValueError: a field has the wrong type, is negative / not finite, a time is
        given both ways or not at all, or ``recompute_s`` names an unknown activation; the
        message names the field.
    """

    param_bytes: int
    grad_bytes: int | None = None
    optimizer_bytes: int = 0
    activations: Mapping[str, int] = dataclasses.field(default_factory=dict)
    intermediate_bytes: int = 0
    carry_bytes: int = 0
    working_bytes: int | None = None
    forward_s: float | None = None
    flops: float | None = None
    flops_per_s: float | None = None
    backward_factor: float = 2.0
    recompute_s: Mapping[str, float] | None = None
    optimizer_s: float = 0.0
    host_update_bytes: int | None = None

    def __post_init__(self):
        o = "LayerCost"
        setf = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        setf("param_bytes", _as_bytes(o, "param_bytes", self.param_bytes))
        setf("grad_bytes", self.param_bytes if self.grad_bytes is None
             else _as_bytes(o, "grad_bytes", self.grad_bytes))
        for k in ("optimizer_bytes", "intermediate_bytes", "carry_bytes"):
            setf(k, _as_bytes(o, k, getattr(self, k)))
        setf("host_update_bytes", 2 * self.param_bytes + self.grad_bytes + 2 * self.optimizer_bytes
             if self.host_update_bytes is None else _as_bytes(o, "host_update_bytes", self.host_update_bytes))
        if not isinstance(self.activations, Mapping):
            raise TypeError(f"{o}.activations must be a mapping name -> bytes, got {type(self.activations).__name__}")
        acts = {}
        for name, b in self.activations.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"{o}.activations: names must be non-empty strings, got {name!r}")
            acts[name] = _as_bytes(o, f"activations[{name!r}]", b)
        setf("activations", FrozenMapping(sorted(acts.items())))
        if self.working_bytes is None:
            setf("working_bytes", sum(acts.values()) + self.intermediate_bytes)
        else:
            setf("working_bytes", _as_bytes(o, "working_bytes", self.working_bytes))
        if self.forward_s is not None:
            if self.flops is not None or self.flops_per_s is not None:
                raise ValueError(f"{o}.forward_s: give either forward_s or flops + flops_per_s, not both")
            setf("forward_s", _as_float(o, "forward_s", self.forward_s, positive=False))
        else:
            if self.flops is None or self.flops_per_s is None:
                raise ValueError(f"{o}.forward_s: the forward time is required: give forward_s (seconds) "
                                 f"or both flops and flops_per_s")
            setf("flops", _as_float(o, "flops", self.flops, positive=False))
            setf("flops_per_s", _as_float(o, "flops_per_s", self.flops_per_s, positive=True))
        setf("backward_factor", _as_float(o, "backward_factor", self.backward_factor, positive=False))
        setf("optimizer_s", _as_float(o, "optimizer_s", self.optimizer_s, positive=False))
        if self.recompute_s is not None:
            if not isinstance(self.recompute_s, Mapping):
                raise TypeError(f"{o}.recompute_s must be a mapping name -> seconds")
            rec = {}
            for name, s in self.recompute_s.items():
                if name not in acts:
                    raise ValueError(f"{o}.recompute_s[{name!r}]: not a named activation of this layer "
                                     f"(activations: {sorted(acts)})")
                rec[name] = _as_float(o, f"recompute_s[{name!r}]", s, positive=False)
            setf("recompute_s", FrozenMapping(sorted(rec.items())))

    @classmethod
    def from_dict(cls, data: Mapping) -> "LayerCost":
        """Build from a mapping (e.g. parsed JSON); unknown keys raise ``ValueError`` naming them."""
        return _from_dict(cls, data)

    @property
    def forward_time_s(self) -> float:
        """Forward time in seconds (measured, or ``flops / flops_per_s``)."""
        return self.forward_s if self.forward_s is not None else self.flops / self.flops_per_s

    @property
    def backward_time_s(self) -> float:
        """Backward time in seconds without recompute: ``backward_factor * forward_time_s``."""
        return self.backward_factor * self.forward_time_s

    def recompute_time_s(self, name: str) -> float:
        """Seconds to recompute named activation ``name`` (``recompute_s`` or its byte share of the forward)."""
        if self.recompute_s is not None and name in self.recompute_s:
            return self.recompute_s[name]
        total = sum(self.activations.values()) + self.intermediate_bytes
        return self.forward_time_s * self.activations[name] / total if total else 0.0


# --------------------------------------------------------------------------- outputs

class InfeasibleBudgetError(ValueError):
    """No policy fits the device-memory budget.

    Attributes:
      budget_bytes: the budget asked for, bytes.
      min_budget_bytes: the exact minimum over all policies of the predicted peak device bytes;
        ``plan(..., budget_bytes=min_budget_bytes)`` succeeds.
      min_policy: a policy reaching that minimum.
    """

    def __init__(self, budget_bytes: int, min_budget_bytes: int, min_policy: OffloadPolicy):
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.min_policy = min_policy
        super().__init__(
            f"device budget {budget_bytes} bytes ({_gib(budget_bytes)}) is infeasible: the minimum feasible "
            f"budget is {min_budget_bytes} bytes ({_gib(min_budget_bytes)}), reached by {min_policy}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A policy with its predictions (bytes, seconds).

    Attributes:
      policy: the chosen :class:`OffloadPolicy`.
      device_bytes: predicted peak device bytes of one device (memory model of the module
        docstring); with ``num_devices > 1`` every byte count of a Plan is per device.
      host_bytes: bytes kept in host memory (one device's share).
      layer_transfer_s: per layer, transfer seconds summed over phases (``Link.transfer_s``).
      layer_compute_s: per layer, compute seconds summed over phases (incl. recompute, update).
      step_s: predicted step time, seconds.
      floor_s: ``max(total compute, total in/h2d, total out/d2h, total/both)``, seconds.
      phase_s: ``{phase: seconds}`` (``forward``; ``backward``, ``optimizer`` when training).
      device_components / host_components: ``{component: bytes}`` (device: at the peak phase).
      peak_phase: which phase sets ``device_bytes``.
      budget_bytes: the budget planned for (``None`` from :func:`evaluate`).
      min_budget_bytes: minimum feasible budget over the search space (``None`` from evaluate).
      num_layers, training, link, target: the inputs (``target``: see :func:`evaluate`).
      phase_layers: per phase, ``((layer, (compute_s, transfer_s)), ...)`` in layer order (a layer's
        copy streamed for the next call, in the steady state, counted with its row); in the
        ``"host"`` optimizer mode also ``"host update"``: ``(layer, (CPU update seconds, 0.0))``.
      optimizer_mode: how the optimizer step runs, one of :data:`OPTIMIZER_MODES` (``None`` in
        inference): ``"device"`` when ``policy.optimizer_state == "device"``, else the faster (or
        the requested) of ``"streamed"`` and ``"host"``.
      optimizer_mode_s: ``{mode: predicted step seconds}`` for every mode the policy's placement
        allows (``{"device": ...}``, or ``{"streamed": ..., "host": ...}``); empty in inference.
      host_update_s: total seconds of CPU optimizer update, ``sum(host_update_bytes) /
        host_memory_gbps`` (0 unless ``optimizer_mode == "host"``).
      num_devices: the devices the stack is sharded over (module docstring, "Several devices").
      steady_state: whether ``step_s`` / ``floor_s`` / the per-layer times describe a call of a loop
        (the cyclic schedule's steady state, the default) or a single, cold call (see :func:`evaluate`).
    """

    policy: OffloadPolicy
    device_bytes: int
    host_bytes: int
    layer_transfer_s: tuple
    layer_compute_s: tuple
    step_s: float
    floor_s: float
    phase_s: Mapping[str, float]
    device_components: Mapping[str, int]
    host_components: Mapping[str, int]
    peak_phase: str
    num_layers: int
    training: bool
    link: Link
    phase_layers: Mapping[str, tuple] = dataclasses.field(repr=False, default_factory=dict)
    budget_bytes: int | None = None
    min_budget_bytes: int | None = None
    target: str = "accelerator"
    optimizer_mode: str | None = None
    optimizer_mode_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    host_update_s: float = 0.0
    steady_state: bool = True
    num_devices: int = 1

    @property
    def slowdown(self) -> float:
        """``step_s / floor_s`` (1.0 when the floor is 0)."""
        return self.step_s / self.floor_s if self.floor_s else 1.0

    def explain(self) -> str:
        """A printable table: per component device / host bytes, per layer transfer / compute
        seconds (per phase), predicted step time against the floor."""
        p = self.policy
        lines = [f"OffloadPolicy: params={p.params} grads={p.grads} optimizer_state={p.optimizer_state} "
                 f"activations={dict(p.activations)} remat={p.remat} prefetch_depth={p.prefetch_depth}",
                 f"mode: {'training' if self.training else 'inference'}, {self.num_layers} layers, "
                 + (f"{self.num_devices} devices (bytes and times per device), " if self.num_devices != 1 else "")
                 + "memory model "
                 f"for {self.target}, link "
                 f"h2d {self.link.h2d_gbps:g} / d2h {self.link.d2h_gbps:g} / both {self.link.both_gbps:g} GB/s"
                 + (f", optimizer mode {self.optimizer_mode}" if self.optimizer_mode else "")
                 + (", times of a call in a loop (steady state)" if self.steady_state
                    else ", times of a single cold call"),
                 "",
                 f"{'component':<34}{'device bytes':>16}{'device GiB':>12}{'host bytes':>16}{'host GiB':>12}"]
        names = list(dict.fromkeys([*self.device_components, *self.host_components]))
        for n in names:
            d, h = self.device_components.get(n, 0), self.host_components.get(n, 0)
            lines.append(f"{n:<34}{d:>16}{d / GiB:>12.3f}{h:>16}{h / GiB:>12.3f}")
        lines.append(f"{'total (peak: ' + self.peak_phase + ')':<34}{self.device_bytes:>16}"
                     f"{self.device_bytes / GiB:>12.3f}{self.host_bytes:>16}{self.host_bytes / GiB:>12.3f}")
        if self.budget_bytes is not None:
            lines.append(f"budget {self.budget_bytes} bytes ({_gib(self.budget_bytes)}); minimum feasible "
                         f"{self.min_budget_bytes} bytes ({_gib(self.min_budget_bytes)})")
        lines.append("")
        phases = list(self.phase_layers)
        hdr = f"{'layer':>5}{'transfer s':>12}{'compute s':>12}"
        for ph in phases:
            hdr += f"{ph[:3] + ' x s':>12}{ph[:3] + ' c s':>12}"
        lines.append(hdr)
        per_phase = {ph: {i: v for i, v in rows} for ph, rows in self.phase_layers.items()}
        for i in range(self.num_layers):
            row = f"{i:>5}{self.layer_transfer_s[i]:>12.4f}{self.layer_compute_s[i]:>12.4f}"
            for ph in phases:
                c, x = per_phase[ph][i]
                row += f"{x:>12.4f}{c:>12.4f}"
            lines.append(row)
        lines.append("")
        lines.append("phases: " + ", ".join(f"{k} {v:.4f} s" for k, v in self.phase_s.items()))
        if self.optimizer_mode is not None:
            modes = ", ".join(f"{m} {t:.4f} s" for m, t in self.optimizer_mode_s.items())
            lines.append(f"optimizer mode: {self.optimizer_mode} (predicted step per mode: {modes}; host memory "
                         f"{self.link.host_memory_gbps:g} GB/s, host update {self.host_update_s:.4f} s)")
        lines.append(f"predicted step {self.step_s:.4f} s / floor {self.floor_s:.4f} s = {self.slowdown:.3f}x")
        return "\n".join(lines)


# --------------------------------------------------------------------------- model

def _resolve_layers(layers, num_layers) -> list[LayerCost]:
    if isinstance(layers, LayerCost):
        if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) or not \
                1 <= num_layers <= MAX_LAYERS:
            raise ValueError(f"num_layers must be an int in 1..{MAX_LAYERS}, got {num_layers!r}")
        return [layers] * int(num_layers)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise TypeError("layers must be a LayerCost or a non-empty sequence of LayerCost")
    for i, l in enumerate(layers):
        if not isinstance(l, LayerCost):
            raise TypeError(f"layers[{i}] must be a LayerCost, got {type(l).__name__}")
    if len(layers) > MAX_LAYERS:
        raise ValueError(f"layers: at most {MAX_LAYERS} LayerCost, got {len(layers)}")
    if num_layers is not None and num_layers != len(layers):
        raise ValueError(f"num_layers={num_layers!r} does not match the {len(layers)} LayerCost given")
    return list(layers)


def _top(values: Iterable[int], n: int) -> int:
    """Sum of the ``n`` largest values."""
    return sum(sorted(values, reverse=True)[:n])


def _placements(policy: OffloadPolicy, layers: list[LayerCost], target: str = "accelerator") -> dict[str, str]:
    """Placement of every named activation; names the policy does not mention are saved on the device.
    On ``"xla_cpu"`` a ``"host"`` placement keeps the device copy (its annotations are stripped)."""
    names = sorted({n for l in layers for n in l.activations} | set(policy.activations))
    out = {n: policy.activations.get(n, "device") for n in names}
    if target == "xla_cpu":
        out = {n: "device" if w == "host" else w for n, w in out.items()}
    return out


def _memory(policy: OffloadPolicy, layers: list[LayerCost], training: bool, target: str = "accelerator"):
    """(peak, peak_phase, device components at peak, host components); terms: module docstring."""
    cpu = target == "xla_cpu"
    # the window: the streaming schedule's live set (k+1 layers, or L), the largest layers in it;
    # XLA:CPU prefetches nothing: the layer being computed
    k1 = 1 if cpu else PrefetchSchedule(len(layers), policy.prefetch_depth, training=training).max_live_stages
    ph, gh, oh = policy.params == "host", policy.grads == "host", policy.optimizer_state == "host"
    P = [l.param_bytes for l in layers]
    a: dict[str, int] = {}
    a["params"] = (0 if cpu else _top(P, k1)) if ph else sum(P)
    host = {"params": sum(P) if ph else 0}
    placed = _placements(policy, layers, target)
    if training:
        G = [l.grad_bytes for l in layers]
        O = [l.optimizer_bytes for l in layers]
        a["grads"] = (0 if cpu else max(G)) if gh else sum(G)
        a["optimizer_state"] = 0 if oh else sum(O)
        host["grads"] = sum(G) if gh else 0
        host["optimizer_state"] = sum(O) if oh else 0
        for name, where in placed.items():
            per = [l.activations.get(name, 0) for l in layers]
            a[f"activation {name}"] = {"device": sum(per), "host": _top(per, k1), "remat": 0}[where]
            host[f"activation {name}"] = sum(per) if where == "host" else 0
        a["intermediates"] = 0 if policy.remat else sum(l.intermediate_bytes for l in layers)
        a["saved layer inputs"] = sum(l.carry_bytes for l in layers)
        a["recompute"] = max((l.intermediate_bytes if policy.remat else 0)
                             + sum(b for n, b in l.activations.items() if placed[n] == "remat") for l in layers)
    if cpu:
        a["operand copies"] = max(
            max(l.param_bytes, l.grad_bytes if training else 0)
            + ((l.carry_bytes + (0 if policy.remat else l.intermediate_bytes)
                + sum(b for n, b in l.activations.items() if placed[n] == "device")) if training else 0)
            for l in layers)
    a["working set"] = max(l.working_bytes for l in layers)
    a["carry"] = max(l.carry_bytes for l in layers)
    peak, phase, comps = sum(a.values()), "forward/backward", a
    if training:
        stream = [(l.param_bytes if ph else 0) + (l.grad_bytes if gh else 0) + (l.optimizer_bytes if oh else 0)
                  for l in layers]
        b = {"params": 0 if ph else sum(P), "grads": 0 if gh else sum(G),
             "optimizer_state": 0 if oh else sum(O), "optimizer stream window": _top(stream, k1)}
        if sum(b.values()) > peak:
            peak, phase, comps = sum(b.values()), "optimizer", b
    return peak, phase, comps, host


def _simulate(rows: list[tuple[float, int, int]], k: int, link: Link) -> float:
    """Streaming schedule of one phase: rows = [(compute_s, in_bytes, out_bytes)] in execution order.

    One compute stream, one H2D and one D2H copy queue.  In-copy j waits for the previous in-copy
    and for the buffer of layer j-k-1; compute j waits for compute j-1, in-copy j and out-copy j-2;
    out-copy j waits for compute j and out-copy j-1.  Both directions in one phase share the
    both-at-once bandwidth in proportion to their bytes.
    """
    tin, tout = sum(r[1] for r in rows), sum(r[2] for r in rows)
    bw_in, bw_out = link.h2d_gbps * GB, link.d2h_gbps * GB
    if tin and tout:
        both = link.both_gbps * GB
        bw_in, bw_out = min(bw_in, both * tin / (tin + tout)), min(bw_out, both * tout / (tin + tout))
    n = len(rows)
    e_in, e_c, e_out = [0.0] * n, [0.0] * n, [0.0] * n
    for j, (c, i, o) in enumerate(rows):
        s = max(e_in[j - 1] if j else 0.0, e_c[j - k - 1] if j - k - 1 >= 0 else 0.0)
        e_in[j] = s + (i / bw_in if i else 0.0)
        s = max(e_c[j - 1] if j else 0.0, e_in[j], e_out[j - 2] if j >= 2 else 0.0)
        e_c[j] = s + c
        e_out[j] = max(e_out[j - 1] if j else 0.0, e_c[j]) + (o / bw_out if o else 0.0)
    return max(e_c[-1], e_out[-1])


def _phases(policy: OffloadPolicy, layers: list[LayerCost], training: bool, steady_state: bool = True):
    """{phase: [(layer index, compute_s, in_bytes, out_bytes)] in execution order}.

    ``steady_state`` (module docstring, "Steady state"; :func:`_weight_copies`): the forward starts with its
    first layers' weights on the device, and the call's last pass (the forward in inference, the
    optimizer phase, which runs in the backward's order, in training) streams the next call's after
    its last row (rows without compute)."""
    ph, gh, oh = policy.params == "host", policy.grads == "host", policy.optimizer_state == "host"
    L = len(layers)
    fwd_in, bwd_in, tail = _weight_copies(policy, L, training, "device", steady_state)
    placed = _placements(policy, layers)
    host_acts = [n for n, w in placed.items() if w == "host"] if training else []
    remat_acts = [n for n, w in placed.items() if w == "remat"]
    act_out = [sum(l.activations.get(n, 0) for n in host_acts) for l in layers]
    fwd = [(i, l.forward_time_s, l.param_bytes if i in fwd_in else 0, act_out[i]) for i, l in enumerate(layers)]
    next_rows = [(i, 0.0, layers[i].param_bytes, 0) for i in tail]   # for the next call, at this call's tail
    out = {"forward": fwd if training else fwd + next_rows}
    if training:
        bwd = []
        for i in reversed(range(L)):
            l = layers[i]
            f = l.forward_time_s
            if policy.remat:
                rec = f
            else:
                rec = min(f, sum(l.recompute_time_s(n) for n in remat_acts if n in l.activations))
            w_in = l.param_bytes if i in bwd_in else 0   # the last k stay from the forward
            bwd.append((i, l.backward_time_s + rec, w_in + act_out[i], l.grad_bytes if gh else 0))
        opt = []
        for i in reversed(range(L)):     # in the backward's order: it ends with the layers the forward starts with
            l = layers[i]
            i_b = (l.param_bytes if ph else 0) + (l.grad_bytes if gh else 0) + (l.optimizer_bytes if oh else 0)
            o_b = (l.param_bytes if ph else 0) + (l.optimizer_bytes if oh else 0)
            opt.append((i, l.optimizer_s, i_b, o_b))
        out["backward"], out["optimizer"] = bwd, opt + next_rows
    return out


def _shared_rates(link: Link, n_in: bool, n_out: bool) -> tuple[float, float]:
    """(H2D, D2H) bytes/s while the copies in ``n_in`` / ``n_out`` run: alone, a direction gets its own
    bandwidth; together they split ``both_gbps`` in proportion to their own bandwidths (each capped
    at it, the other taking what is left)."""
    h, d, b = link.h2d_gbps * GB, link.d2h_gbps * GB, link.both_gbps * GB
    if not (n_in and n_out):
        return (h if n_in else 0.0), (d if n_out else 0.0)
    r_in = min(h, b * h / (h + d))
    r_out = min(d, b - r_in)
    return min(h, b - r_out), r_out


def _simulate_shared(rows: list[tuple[float, int, int]], k: int, link: Link) -> tuple[list[float], list[float]]:
    """The streaming schedule of :func:`_simulate` over ``rows`` = [(compute_s, in_bytes, out_bytes)], with
    the link shared *as the copies overlap*: an event simulation in which a copy moves at its own
    direction's full bandwidth while it runs alone and at its share of ``both_gbps`` while copies run
    in both directions (``_simulate`` gives every copy of a phase its share for the whole phase).

    Dependencies as in ``_simulate``: in-copy j waits for in-copy j-1 and compute j-k-1; compute j for
    compute j-1, in-copy j and out-copy j-2; out-copy j for compute j and out-copy j-1.
    Returns (compute end times, out-copy end times), seconds from the start.
    """
    n = len(rows)
    e_in: list = [None] * n
    e_c: list = [None] * n
    e_out: list = [None] * n
    done = lambda e, j: j < 0 or (e[j] is not None and e[j] <= t)  # noqa: E731
    t, ai, ac, ao = 0.0, 0, 0, 0
    act_in = act_out = None            # [row, remaining bytes, total bytes]
    while True:
        changed = True
        while changed:                  # start whatever is ready at time t
            changed = False
            if act_in is None and ai < n and done(e_in, ai - 1) and done(e_c, ai - k - 1):
                if rows[ai][1]:
                    act_in = [ai, float(rows[ai][1]), float(rows[ai][1])]
                else:
                    e_in[ai] = t
                ai += 1
                changed = True
            if ac < n and done(e_c, ac - 1) and done(e_in, ac) and done(e_out, ac - 2):
                e_c[ac] = t + rows[ac][0]
                ac += 1
                changed = True
            if act_out is None and ao < n and done(e_c, ao) and done(e_out, ao - 1):
                if rows[ao][2]:
                    act_out = [ao, float(rows[ao][2]), float(rows[ao][2])]
                else:
                    e_out[ao] = t
                ao += 1
                changed = True
        if ao == n and act_out is None and ac == n:
            return e_c, e_out
        r_in, r_out = _shared_rates(link, act_in is not None, act_out is not None)
        events = [e for e in e_c if e is not None and e > t]
        if act_in is not None:
            events.append(t + act_in[1] / r_in)
        if act_out is not None:
            events.append(t + act_out[1] / r_out)
        t_next = min(events)
        dt = t_next - t
        for act, r, e in ((act_in, r_in, e_in), (act_out, r_out, e_out)):
            if act is not None:
                if t + act[1] / r <= t_next:    # the same expression as its event: it ends now
                    e[act[0]] = t_next
                else:
                    act[1] = max(act[1] - r * dt, 0.0)
        if act_in is not None and e_in[act_in[0]] is not None:
            act_in = None
        if act_out is not None and e_out[act_out[0]] is not None:
            act_out = None
        t = t_next


def _weight_copies(policy: OffloadPolicy, num_layers: int, training: bool, mode: str, steady_state: bool):
    """``(forward, backward, tail)``: the layers whose weights cross host -> device in a call's forward, in
    its backward, and after its last row for the next call, read from ``StreamingRuntime``'s schedule
    (:class:`~xla_swap.planning.prefetch.PrefetchSchedule`; module docstring, "Steady state").

    Inference: the steady state starts with layers ``0..k-1`` and fetches them again at its tail
    (nothing when ``k >= L``: every layer stays).  Training, when the update runs on the device (modes
    ``"device"`` and ``"streamed"``): the last pass keeps layers ``0..k`` (layer ``k`` in its window's free
    slot), so the forward starts with ``0..min(k, L-1)``; the backward fetches all but
    the last ``k``.  Nothing carries in a single (cold) call and in the ``"host"`` mode, whose CPU update
    rewrites the weights after the backward; nothing moves without host-placed params (every layer
    resident).  ``tail`` in the order of the copies; the others as sets.
    """
    cyclic = steady_state and not (training and mode == "host")
    s = PrefetchSchedule(num_layers, policy.prefetch_depth, training=training,
                         resident=(policy.params != "host",) * num_layers, prefetch_next_call=cyclic)
    return set(s.fetched("forward")), set(s.fetched("backward")) if training else set(), s.next_call_fetches


def _merged(rows, link: Link) -> list:
    """``[(layer, (compute_s, transfer_s))]`` by layer, a layer's rows merged (its tail copy with its row)."""
    per: dict[int, list] = {}
    for i, c, bi, bo in rows:
        acc = per.setdefault(i, [0.0, 0, 0])
        acc[0] += c
        acc[1] += bi
        acc[2] += bo
    return [(i, (c, link.transfer_s(bi, bo))) for i, (c, bi, bo) in sorted(per.items())]


def _offloaded_optimizer(policy: OffloadPolicy, layers: list[LayerCost], link: Link, mode: str,
                         host_overlap: bool = True, steady_state: bool = True) -> dict:
    """Time model of a training step whose optimizer state lives in host memory, in ``mode``
    ``"streamed"`` or ``"host"`` (module docstring, "Optimizer modes"); ``steady_state``: a
    ``"streamed"`` step starts with the first ``min(k + 1, L)`` layers' weights on the device, left
    there by the previous step's backward, and its backward streams layer ``k`` for the next step
    after its last row (:func:`_weight_copies`; module docstring, "Steady state").

    Returns a dict: ``step_s``, ``floor_s``, ``phase_s`` (forward, backward, optimizer: the exposed
    part of the host update), ``phase_layers``, ``layer_transfer_s``, ``layer_compute_s`` (device
    only), ``host_update_s`` (seconds of CPU update, summed).
    """
    gh = policy.grads == "host"
    streamed = mode == "streamed"
    L, k = len(layers), policy.prefetch_depth
    placed = _placements(policy, layers)
    host_acts = [n for n, w in placed.items() if w == "host"]
    remat_acts = [n for n, w in placed.items() if w == "remat"]
    act = [sum(l.activations.get(n, 0) for n in host_acts) for l in layers]
    fwd_in, bwd_in, tail = _weight_copies(policy, L, True, mode, steady_state)
    rows = [(i, l.forward_time_s, l.param_bytes if i in fwd_in else 0, act[i]) for i, l in enumerate(layers)]
    for i in reversed(range(L)):
        l = layers[i]
        rec = l.forward_time_s if policy.remat else \
            min(l.forward_time_s, sum(l.recompute_time_s(n) for n in remat_acts if n in l.activations))
        w_in = l.param_bytes if i in bwd_in else 0   # StreamingRuntime keeps the last k layers across the turn
        if streamed:   # moments in; new weights + moments out; the gradient stays on the device
            rows.append((i, l.backward_time_s + rec + l.optimizer_s, w_in + act[i] + l.optimizer_bytes,
                         l.param_bytes + l.optimizer_bytes))
        else:          # the gradient goes to host memory; the update runs on the CPU
            rows.append((i, l.backward_time_s + rec, w_in + act[i], l.grad_bytes if gh else 0))
    rows += [(i, 0.0, layers[i].param_bytes, 0) for i in tail]   # the next step's layer k, in the free slot
    e_c, e_out = _simulate_shared([r[1:] for r in rows], k, link)
    device_end = max(e_c[-1], e_out[-1])
    host_s = [0.0 if streamed else link.host_update_s(l.host_update_bytes) for l in layers]
    end = device_end
    if not streamed:
        u = 0.0 if host_overlap else device_end
        for j in range(L, 2 * L):          # backward rows, in execution order
            i = rows[j][0]
            u = max(u, e_out[j]) + host_s[i]
        end = max(device_end, u)
    xfer, comp = [0.0] * L, [0.0] * L
    pl = {"forward": _merged(rows[:L], link), "backward": _merged(rows[L:], link)}
    for i, (c, x) in pl["forward"] + pl["backward"]:
        xfer[i] += x
        comp[i] += c
    if not streamed:
        pl["host update"] = [(i, (host_s[i], 0.0)) for i in range(L)]
    tin, tout = sum(r[2] for r in rows), sum(r[3] for r in rows)
    floor = max(sum(r[1] for r in rows), link.transfer_s(tin, tout), sum(host_s))
    fwd_s = e_c[L - 1]
    return {"step_s": end, "floor_s": floor,
            "phase_s": {"forward": fwd_s, "backward": device_end - fwd_s, "optimizer": end - device_end},
            "phase_layers": {name: tuple(sorted(v)) for name, v in pl.items()},
            "layer_transfer_s": tuple(xfer), "layer_compute_s": tuple(comp), "host_update_s": sum(host_s)}


def _offloaded_floor(policy: OffloadPolicy, layers: list[LayerCost], link: Link, mode: str,
                     steady_state: bool = True) -> float:
    """A lower bound of :func:`_offloaded_optimizer`'s step time (its ``floor_s``), without simulating."""
    gh = policy.grads == "host"
    streamed = mode == "streamed"
    placed = _placements(policy, layers)
    fwd_in, bwd_in, tail = _weight_copies(policy, len(layers), True, mode, steady_state)
    acts = sum(l.activations.get(n, 0) for l in layers for n, w in placed.items() if w == "host")
    remat_acts = [n for n, w in placed.items() if w == "remat"]
    comp = sum(l.forward_time_s + l.backward_time_s
               + (l.forward_time_s if policy.remat else
                  min(l.forward_time_s, sum(l.recompute_time_s(n) for n in remat_acts if n in l.activations)))
               + (l.optimizer_s if streamed else 0.0) for l in layers)
    w = sum(layers[i].param_bytes for i in fwd_in)                          # forward: all but the kept first layers
    w_bwd = sum(layers[i].param_bytes for i in bwd_in)                      # backward: all but the last k
    w_bwd += sum(layers[i].param_bytes for i in tail)                       # and layer k for the next step
    if streamed:
        tin = w + w_bwd + acts + sum(l.optimizer_bytes for l in layers)
        tout = acts + sum(l.param_bytes + l.optimizer_bytes for l in layers)
        host = 0.0
    else:
        tin, tout = w + w_bwd + acts, acts + (sum(l.grad_bytes for l in layers) if gh else 0)
        host = sum(link.host_update_s(l.host_update_bytes) for l in layers)
    return max(comp, link.transfer_s(tin, tout), host)


def _floor(phases, link: Link) -> float:
    comp = sum(r[1] for rows in phases.values() for r in rows)
    tin = sum(r[2] for rows in phases.values() for r in rows)
    tout = sum(r[3] for rows in phases.values() for r in rows)
    return max(comp, link.transfer_s(tin, tout))


def _step(phases, policy: OffloadPolicy, link: Link) -> dict[str, float]:
    return {name: _simulate([r[1:] for r in rows], policy.prefetch_depth, link) for name, rows in phases.items()}


def _check_num_devices(num_devices) -> int:
    if isinstance(num_devices, bool) or not isinstance(num_devices, numbers.Integral) or num_devices < 1:
        raise ValueError(f"num_devices must be an int >= 1 (the devices the stack is sharded over), "
                         f"got {num_devices!r}")
    return int(num_devices)


def _per_device(layers: list[LayerCost], n: int) -> list[LayerCost]:
    """One device's share of each layer over ``n`` devices: weights, gradients, optimizer state and
    the CPU update's bytes divided by ``n``, rounded up; the rest as given (module docstring,
    "Several devices")."""
    if n == 1:
        return layers
    shard = lambda b: -(-b // n)  # noqa: E731  (ceil: the largest shard)
    cache = {}
    for l in layers:
        if id(l) not in cache:
            cache[id(l)] = dataclasses.replace(
                l, param_bytes=shard(l.param_bytes), grad_bytes=shard(l.grad_bytes),
                optimizer_bytes=shard(l.optimizer_bytes), host_update_bytes=shard(l.host_update_bytes))
    return [cache[id(l)] for l in layers]


def _check_link(link) -> Link:
    if not isinstance(link, Link):
        raise TypeError(f"link must be a Link, got {type(link).__name__}")
    return link


def _check_training(training) -> bool:
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {training!r}")
    return training


def _check_target(target) -> str:
    if not isinstance(target, str) or target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(map(repr, TARGETS))}, got {target!r}")
    return target


def _check_optimizer_mode(optimizer_mode) -> str | None:
    if optimizer_mode is not None and (not isinstance(optimizer_mode, str) or optimizer_mode not in OPTIMIZER_MODES):
        raise ValueError(f"optimizer_mode must be None (the faster) or one of {', '.join(map(repr, OPTIMIZER_MODES))}, "
                         f"got {optimizer_mode!r}")
    return optimizer_mode


def _check_host_overlap(host_overlap) -> bool:
    if not isinstance(host_overlap, bool):
        raise ValueError(f"host_overlap must be a bool (True: the CPU update of a layer overlaps the backward of the "
                         f"layers before it, as in ZeRO-Offload), got {host_overlap!r}")
    return host_overlap


def _check_steady_state(steady_state) -> bool:
    if not isinstance(steady_state, bool):
        raise ValueError(f"steady_state must be a bool (True: a call of a loop, the cyclic schedule's steady state; "
                         f"False: a single, cold call), got {steady_state!r}")
    return steady_state


def _modes_of(policy: OffloadPolicy, optimizer_mode: str | None) -> tuple[str, ...]:
    """Optimizer modes a training policy allows, restricted to ``optimizer_mode`` when given."""
    allowed = ("device",) if policy.optimizer_state == "device" else ("streamed", "host")
    if optimizer_mode is None:
        return allowed
    return (optimizer_mode,) if optimizer_mode in allowed else ()


def _build(policy, layers, training, link, budget=None, min_budget=None, target="accelerator",
           optimizer_mode=None, host_overlap=True, steady_state=True, num_devices=1) -> Plan:
    peak, phase, comps, host = _memory(policy, layers, training, target)
    if training and policy.optimizer_state == "host":
        res = {m: _offloaded_optimizer(policy, layers, link, m, host_overlap, steady_state) for m in ("streamed", "host")}
        mode = optimizer_mode or min(res, key=lambda m: (res[m]["step_s"], m != "streamed"))
        r = res[mode]
        return Plan(policy=policy, device_bytes=peak, host_bytes=sum(host.values()),
                    layer_transfer_s=r["layer_transfer_s"], layer_compute_s=r["layer_compute_s"],
                    step_s=r["step_s"], floor_s=r["floor_s"], phase_s=r["phase_s"], device_components=comps,
                    host_components=host, peak_phase=phase, num_layers=len(layers), training=training, link=link,
                    phase_layers=r["phase_layers"], budget_bytes=budget, min_budget_bytes=min_budget, target=target,
                    optimizer_mode=mode, optimizer_mode_s={m: v["step_s"] for m, v in res.items()},
                    host_update_s=r["host_update_s"] if mode == "host" else 0.0, steady_state=steady_state,
                    num_devices=num_devices)
    phases = _phases(policy, layers, training, steady_state)
    phase_s = _step(phases, policy, link)
    L = len(layers)
    xfer, comp = [0.0] * L, [0.0] * L
    phase_layers = {}
    for name, rows in phases.items():
        pl = _merged(rows, link)        # a layer may have two rows (its copy for the next call)
        for i, (c, x) in pl:
            xfer[i] += x
            comp[i] += c
        phase_layers[name] = tuple(pl)
    return Plan(policy=policy, device_bytes=peak, host_bytes=sum(host.values()), layer_transfer_s=tuple(xfer),
                layer_compute_s=tuple(comp), step_s=sum(phase_s.values()), floor_s=_floor(phases, link),
                phase_s=phase_s, device_components=comps, host_components=host, peak_phase=phase,
                num_layers=L, training=training, link=link, phase_layers=phase_layers,
                budget_bytes=budget, min_budget_bytes=min_budget, target=target,
                optimizer_mode="device" if training else None,
                optimizer_mode_s={"device": sum(phase_s.values())} if training else {}, steady_state=steady_state,
                num_devices=num_devices)


def evaluate(policy: OffloadPolicy, layers: LayerCost | Sequence[LayerCost], num_layers: int | None = None,
             link: Link = H200_PINNED, *, training: bool = True, target: str = "accelerator",
             optimizer_mode: str | None = None, host_overlap: bool = True, steady_state: bool = True,
             num_devices: int = 1) -> Plan:
    """Predict device bytes and step time of one ``policy`` (no budget, no search).

    Args:
      policy: the :class:`OffloadPolicy` to evaluate.
      layers: one :class:`LayerCost` repeated ``num_layers`` times, or one per layer.
      num_layers: number of layers (required with a single LayerCost).
      link: host link bandwidths (GB/s); default :data:`H200_PINNED` (docs/measured.md).
      training: forward + backward + optimizer step (True) or forward only (False).
      target: the compiler the memory model describes, one of :data:`TARGETS`: ``"accelerator"``
        (default; XLA:GPU / XLA:TPU with host offloading) or ``"xla_cpu"`` (XLA:CPU strips the
        placement annotations, prefetches nothing and materialises per-layer slices; module
        docstring, "Target").  The time model is the same for both.
      optimizer_mode: ``None`` (default: with ``policy.optimizer_state == "host"`` the faster of
        ``"streamed"`` and ``"host"``), or one of :data:`OPTIMIZER_MODES`, which must match the
        policy's ``optimizer_state`` (``"device"`` for ``"device"``; ``"streamed"`` / ``"host"`` for
        ``"host"``).  Ignored in inference.  Module docstring, "Optimizer modes".
      host_overlap: in the ``"host"`` mode, whether each layer's CPU update starts as soon as its
        gradient reached host memory, overlapping the backward of the layers before it (True,
        ZeRO-Offload; default) or only after the whole backward (False, FSDP2's
        ``optimizer.step()`` after ``loss.backward()``).
      steady_state: ``True`` (default): the time of one call in a loop of calls, the steady state of
        ``StreamingRuntime``'s cyclic schedule (``prefetch_next_call=True``): the call starts with its
        first ``k`` layers' weights on the device (``k+1`` in training), streamed or kept by the call
        before.  ``False``: a single, cold call (the first of a loop, or ``prefetch_next_call=False``):
        every weight it uses streams in during the call.
        Module docstring, "Steady state".  The memory model is the same for both.
      num_devices: the devices the stack is sharded over, FSDP-style or tensor-parallel (default 1):
        each holds and moves ``1/n`` of every layer's weights, gradients and optimizer state; the
        other LayerCost fields (compute, activations) and ``link`` are per device as given, and so
        is every byte and time of the result (module docstring, "Several devices").

    Named activations of the layers that ``policy.activations`` does not mention are treated as
    ``"device"`` (saved on the device); in inference activation placements are ignored.

    Returns: a :class:`Plan` (``budget_bytes`` / ``min_budget_bytes`` are ``None``).
    Raises: TypeError / ValueError for invalid arguments, naming them; ``ValueError`` when
    ``policy.activations`` names an activation no layer has (as the scan helpers do when no
    ``offload_name`` tagged it), when ``optimizer_mode`` is not in :data:`OPTIMIZER_MODES` or does
    not match ``policy.optimizer_state``, or when ``host_overlap`` or ``steady_state`` is not a bool.
    """
    n_dev = _check_num_devices(num_devices)
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy must be an OffloadPolicy, got {type(policy).__name__}")
    layers = _per_device(_resolve_layers(layers, num_layers), n_dev)
    known = {n for l in layers for n in l.activations}
    unknown = sorted(set(policy.activations) - known)
    if unknown:
        raise ValueError(f"policy.activations names {unknown}, which no layer's LayerCost.activations has; "
                         f"known names: {sorted(known) or 'none'}")
    training = _check_training(training)
    mode = _check_optimizer_mode(optimizer_mode)
    overlap = _check_host_overlap(host_overlap)
    steady = _check_steady_state(steady_state)
    if training and mode is not None and not _modes_of(policy, mode):
        raise ValueError(f"optimizer_mode={mode!r} does not match policy.optimizer_state="
                         f"{policy.optimizer_state!r}: use {' or '.join(map(repr, _modes_of(policy, None)))}")
    return _build(policy, layers, training, _check_link(link), target=_check_target(target),
                  optimizer_mode=mode if training else None, host_overlap=overlap, steady_state=steady,
                  num_devices=n_dev)


def _candidates(layers: list[LayerCost], training: bool, max_depth: int):
    """All policies of the search space, in a fixed order (module docstring, rules 1-2)."""
    names = sorted({n for l in layers for n in l.activations}) if training else []
    if len(names) > MAX_NAMED_ACTIVATIONS:
        raise ValueError(f"activations: at most {MAX_NAMED_ACTIVATIONS} distinct named activations can be "
                         f"searched exhaustively, got {len(names)}; group some under one name")
    pgo = ([("device",) * 3, ("host", "device", "device"), ("host", "host", "device"), ("host",) * 3]
           if training else [("device",) * 3, ("host", "device", "device")])
    for (p, g, o), acts, remat, depth in itertools.product(
            pgo, itertools.product(("device", "host", "remat"), repeat=len(names)),
            (False, True) if training else (False,), range(1, max_depth + 1)):
        streams = p == "host" or o == "host" or "host" in acts
        if depth > 1 and not streams:
            continue  # prefetch depth is meaningless when nothing streams
        yield OffloadPolicy(params=p, grads=g, optimizer_state=o, activations=dict(zip(names, acts)),
                            remat=remat, prefetch_depth=depth)


def _complexity(p: OffloadPolicy) -> int:
    return ((p.params == "host") + (p.grads == "host") + (p.optimizer_state == "host")
            + sum(w != "device" for w in p.activations.values()) + p.remat + (p.prefetch_depth - 1))


def _space(layers, training, max_prefetch_depth, target="accelerator"):
    if isinstance(max_prefetch_depth, bool) or not isinstance(max_prefetch_depth, numbers.Integral) \
            or not 1 <= max_prefetch_depth <= 16:
        raise ValueError(f"max_prefetch_depth must be an int in 1..16, got {max_prefetch_depth!r}")
    out = []
    for idx, pol in enumerate(_candidates(layers, training, int(max_prefetch_depth))):
        peak = _memory(pol, layers, training, target)[0]
        out.append((idx, pol, peak))
    return out


def min_feasible_bytes(layers: LayerCost | Sequence[LayerCost], num_layers: int | None = None, *,
                       training: bool = True, max_prefetch_depth: int = 4, target: str = "accelerator",
                       num_devices: int = 1) -> int:
    """The exact minimum, over the search space of :func:`plan`, of the predicted peak device bytes
    (``target`` and ``num_devices`` as in :func:`evaluate`; per device).

    Raises: TypeError / ValueError for invalid arguments, naming them.
    """
    n_dev = _check_num_devices(num_devices)
    layers = _per_device(_resolve_layers(layers, num_layers), n_dev)
    return min(peak for _, _, peak in _space(layers, _check_training(training), max_prefetch_depth,
                                             _check_target(target)))


def plan(layers: LayerCost | Sequence[LayerCost], num_layers: int | None = None, budget_bytes: int | None = None,
         link: Link = H200_PINNED, *, training: bool = True, max_prefetch_depth: int = 4,
         target: str = "accelerator", optimizer_mode: str | None = None, host_overlap: bool = True,
         steady_state: bool = True, num_devices: int = 1) -> Plan:
    """Choose the policy with the lowest predicted step time whose predicted device bytes fit.

    Args:
      layers: one :class:`LayerCost` repeated ``num_layers`` times, or a sequence, one per layer.
      num_layers: number of layers (required with a single LayerCost; must match a sequence).
      budget_bytes: device-memory budget in bytes (required).
      link: host link bandwidths in GB/s; default :data:`H200_PINNED` (54/54/93 GB/s, docs/measured.md).
      training: True for forward + backward + optimizer step, False for inference (forward only:
        no gradients, optimizer state or saved activations; the policy's activations are empty).
      max_prefetch_depth: largest ``prefetch_depth`` considered (1..16, default 4).
      target: the compiler the memory model describes (:data:`TARGETS`; see :func:`evaluate`).
      optimizer_mode: ``None`` (default): every policy; one with its optimizer state in host memory
        is timed in the faster of the ``"streamed"`` and ``"host"`` modes.  One of
        :data:`OPTIMIZER_MODES`: only the policies that allow it (``"device"``: state on the
        device; ``"streamed"`` / ``"host"``: state on the host), timed in that mode.  Ignored in
        inference.
      host_overlap: as in :func:`evaluate` (the ``"host"`` mode's overlap with the backward).
      steady_state: as in :func:`evaluate`: time a call of a loop (default) or a single, cold call.
      num_devices: as in :func:`evaluate` (default 1): the stack sharded over ``n`` devices; the
        budget is one device's memory and the Plan's bytes and times are per device.

    Returns: a :class:`Plan` (its ``optimizer_mode`` says how the optimizer step runs).  Search, tie-breaking and the order in which shrinking budgets move
    components to the host: see the module docstring.

    Raises:
      InfeasibleBudgetError: no policy fits; ``.min_budget_bytes`` is the exact minimum (bytes),
        stated in the message in bytes and GiB.
      TypeError / ValueError: invalid arguments, naming them.
    """
    n_dev = _check_num_devices(num_devices)
    layers = _per_device(_resolve_layers(layers, num_layers), n_dev)
    training = _check_training(training)
    link = _check_link(link)
    target = _check_target(target)
    mode = _check_optimizer_mode(optimizer_mode) if training else _check_optimizer_mode(optimizer_mode) and None
    overlap = _check_host_overlap(host_overlap)
    steady = _check_steady_state(steady_state)
    if budget_bytes is None:
        raise ValueError("budget_bytes is required (device-memory budget in bytes)")
    budget = _as_bytes("plan", "budget_bytes", budget_bytes)
    space = _space(layers, training, max_prefetch_depth, target)
    if mode is not None:
        space = [c for c in space if _modes_of(c[1], mode)]
    min_idx, min_pol, min_peak = min(space, key=lambda t: (t[2], _complexity(t[1]), t[0]))
    feasible = [(idx, pol, peak) for idx, pol, peak in space if peak <= budget]
    if not feasible:
        raise InfeasibleBudgetError(budget, min_peak, min_pol)
    # Branch and bound on the floor (a lower bound of the step time) to avoid simulating everything.
    # A policy with its optimizer state on the host is one candidate per allowed mode.
    scored = []
    for idx, pol, peak in feasible:
        if training and pol.optimizer_state == "host":
            for m in _modes_of(pol, mode):
                scored.append((_offloaded_floor(pol, layers, link, m, steady), idx, pol, peak, m))
        else:
            phases = _phases(pol, layers, training, steady)
            scored.append((_floor(phases, link), idx, pol, peak, phases))
    scored.sort(key=lambda t: (t[0], t[1], isinstance(t[4], str) and t[4] != "streamed"))
    best = math.inf
    timed = []
    for fl, idx, pol, peak, how in scored:
        if fl > best * (1 + _REL_TIE):
            break
        if isinstance(how, str):
            t = _offloaded_optimizer(pol, layers, link, how, overlap, steady)["step_s"]
        else:
            t = sum(_step(how, pol, link).values())
        best = min(best, t)
        timed.append((t, idx, pol, peak, how if isinstance(how, str) else None))
    near = [c for c in timed if c[0] <= best * (1 + _REL_TIE)]

    def host_bytes(pol):
        return _memory(pol, layers, training, target)[3]

    _, _, chosen, _, how = min(near, key=lambda c: (sum(host_bytes(c[2]).values()), _complexity(c[2]), c[3], c[1],
                                                     c[4] not in (None, "streamed")))
    return _build(chosen, layers, training, link, budget, min_peak, target, optimizer_mode=how,
                  host_overlap=overlap, steady_state=steady, num_devices=n_dev)
