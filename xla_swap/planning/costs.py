"""What the planner is told about a model and a machine: per-layer costs (:class:`LayerCost`) and the host link (:class:`Link`).

Sizes in bytes, times in seconds, bandwidths in GB/s (1e9 bytes/s); docs/reference/planner.md describes
how the planner uses them. Pure Python.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from xla_swap.planning.policy import FrozenMapping
from xla_swap.planning.units import GB, as_amount, as_bytes, as_float, from_dict

__all__ = ["HOST_MEMORY_GBPS", "Link", "H200_PINNED", "adam_state_bytes", "LayerCost"]

#: Host memory bandwidth in GB/s (1e9 bytes/s) of the GPU host: a 2 GiB bf16 ``copy_`` moved
#: 21.2 GB/s (docs/explanation/measured-facts.md, section 7, the FSDP2 anchor on the H100 machine). Used as the
#: bytes *touched* (read + written) per second by a CPU optimizer update.
HOST_MEMORY_GBPS = 21.2


@dataclasses.dataclass(frozen=True)
class Link:
    """Host <-> device link bandwidths of **one device**, in GB/s (1e9 bytes/s).

    Per device: with ``num_devices > 1`` each device has its own link (its own PCIe link to the
    host memory attached to it) and moves its own shard over it; ``host_memory_gbps`` is the host
    memory bandwidth one device's CPU update gets (docs/reference/planner.md, "Several devices").

    Args:
      h2d_gbps: host-to-device bandwidth when only that direction moves.
      d2h_gbps: device-to-host bandwidth when only that direction moves.
      both_gbps: aggregate bandwidth (sum of both directions) when both move at once; ``None``
        means full duplex (``h2d_gbps + d2h_gbps``).  docs/explanation/measured-facts.md measured ~93 GB/s on an H200,
        not 2 x 54.
      host_memory_gbps: host memory bandwidth in GB/s: the bytes a CPU optimizer update reads
        plus writes per second (the third resource, beside PCIe and device compute, of the
        ``"host"`` optimizer mode).  Default :data:`HOST_MEMORY_GBPS` = 21.2 GB/s, the bf16 copy
        measured on the H100 host (docs/explanation/measured-facts.md, section 7).

    Raises:
      TypeError / ValueError: a bandwidth is not a finite number > 0 (the message names it).
    """

    h2d_gbps: float
    d2h_gbps: float
    both_gbps: float | None = None
    host_memory_gbps: float = HOST_MEMORY_GBPS

    def __post_init__(self):
        object.__setattr__(self, "host_memory_gbps",
                           as_float("Link", "host_memory_gbps", self.host_memory_gbps, positive=True))
        for name in ("h2d_gbps", "d2h_gbps"):
            object.__setattr__(self, name, as_float("Link", name, getattr(self, name), positive=True))
        if self.both_gbps is None:  # full duplex: the error, if any, is about the two fields given
            both = self.h2d_gbps + self.d2h_gbps
            if not math.isfinite(both):
                raise ValueError(f"Link.h2d_gbps + Link.d2h_gbps (the default both_gbps) must be finite, got "
                                 f"{self.h2d_gbps!r} + {self.d2h_gbps!r}")
        else:
            both = as_float("Link", "both_gbps", self.both_gbps, positive=True)
        object.__setattr__(self, "both_gbps", both)

    @classmethod
    def from_dict(cls, data: Mapping) -> "Link":
        """Build from a mapping; unknown keys raise ``ValueError`` naming them."""
        return from_dict(cls, data)

    def transfer_s(self, in_bytes: float, out_bytes: float) -> float:
        """Seconds to move ``in_bytes`` host->device and ``out_bytes`` device->host together:
        ``max(in/h2d, out/d2h, (in+out)/both)`` (0 when nothing moves).

        Raises: TypeError / ValueError: a byte count is not a finite real number >= 0 (named).
        """
        in_bytes = as_amount("Link.transfer_s", "in_bytes", in_bytes)
        out_bytes = as_amount("Link.transfer_s", "out_bytes", out_bytes)
        t = max(in_bytes / (self.h2d_gbps * GB), out_bytes / (self.d2h_gbps * GB))
        if in_bytes and out_bytes:
            t = max(t, (in_bytes + out_bytes) / (self.both_gbps * GB))
        return t

    def host_update_s(self, touched_bytes: float) -> float:
        """Seconds for a CPU optimizer update that reads plus writes ``touched_bytes`` bytes of host
        memory: ``touched_bytes / host_memory_gbps`` (the update is memory-bound).

        Raises: TypeError / ValueError: ``touched_bytes`` is not a finite real number >= 0.
        """
        touched_bytes = as_amount("Link.host_update_s", "touched_bytes", touched_bytes)
        return touched_bytes / (self.host_memory_gbps * GB)


#: Pinned host memory on an NVIDIA H200 (docs/explanation/measured-facts.md, section 4): 54 GB/s each way,
#: ~93 GB/s both at once.
H200_PINNED = Link(h2d_gbps=54.0, d2h_gbps=54.0, both_gbps=93.0)


def adam_state_bytes(num_params: int, state_dtype_bytes: int = 4) -> int:
    """Bytes of Adam state for ``num_params`` parameters: two moments (m, v) of
    ``state_dtype_bytes`` each (fp32 by default: 8 bytes/parameter, i.e. 2x the fp32 params,
    4x bf16 params).  Raises ``ValueError`` / ``TypeError`` for negative or non-integer input."""
    n = as_bytes("adam_state_bytes", "num_params", num_params)
    return 2 * n * as_bytes("adam_state_bytes", "state_dtype_bytes", state_dtype_bytes)


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
        (14 bytes per bf16 parameter with bf16 moments; docs/explanation/measured-facts.md, section 7).  Give it
        for other layouts, e.g. fp32 master weights beside bf16 device weights.
      update_bytes: the weights an update on the device writes back to host memory: the trainable
        ones (frozen weights, e.g. a LoRA model's base, get no gradient and never move back).
        ``None`` (default) means ``grad_bytes``.

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
    update_bytes: int | None = None

    def __post_init__(self):
        owner = "LayerCost"
        setf = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        setf("param_bytes", as_bytes(owner, "param_bytes", self.param_bytes))
        setf("grad_bytes", self.param_bytes if self.grad_bytes is None
             else as_bytes(owner, "grad_bytes", self.grad_bytes))
        for k in ("optimizer_bytes", "intermediate_bytes", "carry_bytes"):
            setf(k, as_bytes(owner, k, getattr(self, k)))
        setf("update_bytes", self.grad_bytes if self.update_bytes is None
             else as_bytes(owner, "update_bytes", self.update_bytes))
        setf("host_update_bytes", 2 * self.param_bytes + self.grad_bytes + 2 * self.optimizer_bytes
             if self.host_update_bytes is None else as_bytes(owner, "host_update_bytes", self.host_update_bytes))
        if not isinstance(self.activations, Mapping):
            raise TypeError(f"{owner}.activations must be a mapping name -> bytes, got {type(self.activations).__name__}")
        acts = {}
        for name, b in self.activations.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"{owner}.activations: names must be non-empty strings, got {name!r}")
            acts[name] = as_bytes(owner, f"activations[{name!r}]", b)
        setf("activations", FrozenMapping(sorted(acts.items())))
        if self.working_bytes is None:
            setf("working_bytes", sum(acts.values()) + self.intermediate_bytes)
        else:
            setf("working_bytes", as_bytes(owner, "working_bytes", self.working_bytes))
        if self.forward_s is not None:
            if self.flops is not None or self.flops_per_s is not None:
                raise ValueError(f"{owner}.forward_s: give either forward_s or flops + flops_per_s, not both")
            setf("forward_s", as_float(owner, "forward_s", self.forward_s, positive=False))
        else:
            if self.flops is None or self.flops_per_s is None:
                raise ValueError(f"{owner}.forward_s: the forward time is required: give forward_s (seconds) "
                                 f"or both flops and flops_per_s")
            setf("flops", as_float(owner, "flops", self.flops, positive=False))
            setf("flops_per_s", as_float(owner, "flops_per_s", self.flops_per_s, positive=True))
        setf("backward_factor", as_float(owner, "backward_factor", self.backward_factor, positive=False))
        setf("optimizer_s", as_float(owner, "optimizer_s", self.optimizer_s, positive=False))
        if self.recompute_s is not None:
            if not isinstance(self.recompute_s, Mapping):
                raise TypeError(f"{owner}.recompute_s must be a mapping name -> seconds")
            rec = {}
            for name, s in self.recompute_s.items():
                if name not in acts:
                    raise ValueError(f"{owner}.recompute_s[{name!r}]: not a named activation of this layer "
                                     f"(activations: {sorted(acts)})")
                rec[name] = as_float(owner, f"recompute_s[{name!r}]", s, positive=False)
            setf("recompute_s", FrozenMapping(sorted(rec.items())))

    @classmethod
    def from_dict(cls, data: Mapping) -> "LayerCost":
        """Build from a mapping (e.g. parsed JSON); unknown keys raise ``ValueError`` naming them."""
        return from_dict(cls, data)

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
