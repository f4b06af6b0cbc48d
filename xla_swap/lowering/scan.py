"""``scan`` / ``scan_layers`` with a placement policy: swap stacked layer weights per iteration.

Same signatures as ``torch_xla.experimental.scan.scan`` and
``torch_xla.experimental.scan_layers.scan_layers``, plus ``policy``. With the all-device
policy they call torch_xla's functions unchanged. Otherwise:

* ``params="host"``: every tensor leaf of ``xs`` (the stacked per-layer weights) is
  host-resident; the body of iteration ``i`` starts with ``place_to_device(xs[i])``, so each
  iteration moves only its own layer slice. The backward pass recomputes that annotation
  from the host slice (the saved residual is the slice of ``xs`` itself, which torch_xla's
  scan does not copy), so the weights come in again rather than being kept on the device.
* ``grads="host"``: the gradient of each layer slice is annotated ``place_to_host`` as soon
  as that layer's backward produced it; scan stacks the slices into the gradient of ``xs``.
* ``activations={name: "host"|"device"|"remat"}`` for tensors tagged ``offload_name``, and
  ``remat`` for untagged intermediates: decided by :func:`policy_partition`.
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable

import torch
import torch.fx as fx
from torch_xla.experimental import scan as _txs

from xla_swap._compat import torch_xla as _ctx   # every private torch_xla / torch API used here
from xla_swap.lowering._checks import ScanArgumentError, ScanDeviceError, check_bool, check_callable, describe_fn
from xla_swap.lowering.offload import (OFFLOAD_NAME, PLACE_TO_DEVICE, PLACE_TO_HOST, place_to_device,
                                       slice_sharding)
from xla_swap.planning.policy import ALL_DEVICE, OffloadPolicy

log = logging.getLogger(__name__)

#: AOTAutograd's default partitioner: the ``partition_fn`` default of torch_xla's scan.
default_partition = _ctx.default_partition_fn()
tree_flatten, tree_unflatten, tree_map = _ctx.tree_flatten, _ctx.tree_unflatten, _ctx.tree_map


def _check_policy(policy) -> OffloadPolicy:
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy: expected an xla_swap.OffloadPolicy, got {type(policy).__name__}")
    return policy


def policy_partition(policy: OffloadPolicy) -> Callable:
    """An AOTAutograd partition function implementing ``policy`` (activations part).

    Forward nodes are those that do not depend on a tangent. A forward value the backward
    needs is *recomputed* in the backward when it is a ``place_to_device`` of a scan input
    (re-fetch the weight slice from the host), a tagged activation whose policy is
    ``"remat"``, or (with ``policy.remat``) any untagged intermediate; otherwise it is
    *saved*. A saved tensor tagged ``offload_name(t, name)`` with policy ``"host"`` is saved
    as ``place_to_host(t)`` and brought back with ``place_to_device`` in the backward.

    Returns:
      ``partition_fn(joint_module, joint_inputs, *, num_fwd_outputs, **kw) -> (fwd, bwd)``.

    Raises (when called by AOTAutograd):
      ValueError: a name in ``policy.activations`` that no ``offload_name`` in the traced
        function tagged (the message lists the tagged names).
    """

    def partition(joint_module: fx.GraphModule, joint_inputs, *, num_fwd_outputs, **kwargs):
        graph = joint_module.graph
        tagged = {n.args[1]: n for n in graph.nodes if n.target is OFFLOAD_NAME}
        unknown = sorted(set(policy.activations) - set(tagged))
        if unknown:
            raise ValueError(f"policy.activations names {unknown} that no offload_name(t, name) in the scanned "
                             f"function tagged; tagged names: {sorted(tagged) or 'none'}")
        bwd = _backward_nodes(graph)
        out_node = next(n for n in graph.nodes if n.op == "output")
        bwd_outputs = [a for a in out_node.args[0][num_fwd_outputs:] if isinstance(a, fx.Node)]
        recomputable = _recomputable(policy, _weight_only_nodes(graph, bwd))
        saved, recomputed = _saved_and_recomputed(graph, bwd, bwd_outputs, recomputable)
        # Nodes the forward outputs need stay as they are; the rest of what reads a saved value
        # (backward nodes and forward-only values recomputed for the backward) may be redirected.
        fwd_needed = _ancestors(a for a in out_node.args[0][:num_fwd_outputs] if isinstance(a, fx.Node))
        backward_side = bwd | (recomputed - fwd_needed)
        final, mapping = _offload_saved(graph, saved, policy, backward_side)
        _copy_shared_views(graph, recomputed, fwd_needed, mapping, backward_side)
        # Graph order, so that saved slices of xs come in xs order: torch_xla's scan re-inserts
        # the activations that alias xs assuming that order (scan.py: alias_input).
        position = {n: i for i, n in enumerate(graph.nodes)}
        final = sorted(dict.fromkeys(final), key=position.__getitem__)
        graph.lint()
        log.debug('joint graph after policy partition:\n%s', graph)
        joint_module.recompile()
        fwd, bwd_mod = _ctx.extract_fwd_bwd_modules(joint_module, final, num_fwd_outputs=num_fwd_outputs)
        log.debug('forward graph:\n%s\nbackward graph:\n%s', fwd.graph, bwd_mod.graph)
        return fwd, bwd_mod

    return partition



def _backward_nodes(graph: fx.Graph) -> set:
    """The backward: the tangent placeholders and every node depending on one."""
    bwd = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or (
                n.op == "call_function" and any(a in bwd for a in n.all_input_nodes)):
            bwd.add(n)
    return bwd


def _weight_only_nodes(graph: fx.Graph, bwd: set) -> set:
    """Values computed from swapped weight slices alone (the slice on the device, its transposes
    and views): recomputed in the backward from the host slice, never saved."""
    weight_only = set()
    for n in graph.nodes:
        if n.op == "call_function" and n not in bwd and n.all_input_nodes and (
                (n.target is PLACE_TO_DEVICE and all(a.op == "placeholder" for a in n.all_input_nodes))
                or all(a in weight_only for a in n.all_input_nodes)):
            weight_only.add(n)
    return weight_only


def _recomputable(policy: OffloadPolicy, weight_only: set) -> Callable:
    """``node -> bool``: whether the backward recomputes a forward value (``policy_partition``'s rule)."""
    def recomputable(n: fx.Node) -> bool:
        if n.op == "get_attr":
            return True  # a constant of the traced function (e.g. torch.tensor([...])): both graphs hold it
        if n.op != "call_function":
            return False
        if n in weight_only or n.target in _VIEW_OPS:
            return True  # re-fetch from host / a free view of something else that is kept
        tag = _tag_of(n)
        if tag is not None and tag.args[1] in policy.activations:
            return policy.activations[tag.args[1]] == "remat"
        return policy.remat and n.target is not PLACE_TO_HOST
    return recomputable


def _saved_and_recomputed(graph: fx.Graph, bwd: set, bwd_outputs: list, recomputable: Callable) -> tuple:
    """``(saved, recomputed)``: the forward values the backward reads, saved (in first-need order) or
    recomputed (with what they read, transitively)."""
    saved, seen, recomputed = [], set(), set()

    def need(n: fx.Node):
        if n in seen or n in bwd:
            return
        seen.add(n)
        if recomputable(n):
            recomputed.add(n)
            for a in n.all_input_nodes:
                need(a)
        else:
            saved.append(n)

    for n in graph.nodes:
        if n in bwd:
            for a in n.all_input_nodes:
                need(a)
    for n in bwd_outputs:
        need(n)
    return saved, recomputed


def _ancestors(nodes) -> set:
    """``nodes`` and every node they read, transitively."""
    found, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


def _offload_saved(graph: fx.Graph, saved: list, policy: OffloadPolicy, backward_side: set) -> tuple:
    """Tagged activations saved on the host: ``place_to_host(t)`` is saved and ``place_to_device`` brings
    it back for the backward's readers. Returns ``(saved values, {saved node: its device copy})``."""
    final, moved, mapping = [], {}, {}
    for n in saved:
        tag = _tag_of(n)
        if tag is None or policy.activations.get(tag.args[1]) != "host":
            final.append(n)
            continue
        if tag not in moved:
            src = tag.args[0]  # offload_name is the identity: move its operand, defined before all readers
            with graph.inserting_after(src):
                host = graph.call_function(PLACE_TO_HOST, (src, ""))
            with graph.inserting_after(host):
                back = graph.call_function(PLACE_TO_DEVICE, (host, "", False))
            for new in (host, back):
                new.meta.update({k: v for k, v in tag.meta.items() if k in ("val", "tensor_meta")})
            moved[tag] = back
            final.append(host)
        mapping[n] = moved[tag]
        for user in list(n.users):
            if user in backward_side:
                user.replace_input_with(n, moved[tag])
    return final, mapping


def _copy_shared_views(graph: fx.Graph, recomputed: set, fwd_needed: set, mapping: dict, backward_side: set) -> None:
    """A recomputed view that the forward also uses (e.g. a reshape of the tagged tensor) is copied for
    the backward, reading the host copy, so the backward never needs the original."""
    for u in list(graph.nodes):
        if u in recomputed and u in fwd_needed and any(a in mapping for a in u.all_input_nodes):
            with graph.inserting_after(u):
                c = graph.node_copy(u, lambda a: mapping.get(a, a))
            c.meta = dict(u.meta)
            mapping[u] = c
            for user in list(u.users):
                if user in backward_side:
                    user.replace_input_with(u, c)

_VIEW_OPS = {torch.ops.aten.t.default, torch.ops.aten.permute.default, torch.ops.aten.view.default,
             torch.ops.aten._unsafe_view.default, torch.ops.aten.expand.default, torch.ops.aten.detach.default,
             torch.ops.aten.transpose.int, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim}


def _tag_of(n: fx.Node):
    """The ``offload_name`` node that tags the value of ``n`` (through detach/alias chains), or None."""
    while n.op == "call_function" and n.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        n = n.args[0]
    if n.op == "call_function" and n.target is OFFLOAD_NAME:
        return n
    return next((u for u in n.users if u.op == "call_function" and u.target is OFFLOAD_NAME), None)


def _describe(value) -> str:
    """``value`` in a message: a tensor's shape and dtype, a sequence's length and element types."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} {value.dtype}"
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(_describe(v) if isinstance(v, torch.Tensor) else type(v).__name__ for v in value[:4])
        return f"a {type(value).__name__} of {len(value)} ({kinds}{', ...' if len(value) > 4 else ''})"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"a value of type {type(value).__name__}"


def _checked_body(fn: Callable, init, what: str) -> Callable:
    """``fn`` whose output is checked against torch_xla's scan contract when it is traced:
    ``fn(carry, x) -> (new_carry, y)``, ``new_carry`` of ``init``'s structure, shapes and dtypes,
    ``y`` a pytree of tensors. ``what`` names the body in messages (``"fn: 'body'"``).

    Raises (while tracing, before anything is lowered):
      ScanArgumentError: ``fn`` returns something other than a tuple or list of two (torch_xla
        raises ``ValueError`` or ``AssertionError`` there).
      ValueError: the carry's structure or a leaf's shape differs from ``init``'s.
      TypeError: a carry leaf's dtype differs from ``init``'s; a leaf of the carry or ``y`` is not
        a tensor.
    """
    flat_init, init_spec = tree_flatten(init)
    want = [(tuple(t.shape), t.dtype) for t in flat_init]

    def body(carry, x):
        out = fn(carry, x)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ScanArgumentError(f"{what} returned {_describe(out)}; expected a (carry, y) pair, as torch_xla's "
                                    f"scan: fn(carry, x) -> (new_carry, y), new_carry like init")
        flat, spec = tree_flatten(out[0])
        if spec != init_spec:
            raise ValueError(f"{what} returned a carry that is {_describe(out[0])}, expected the structure of init, "
                             f"{_describe(init)}")
        for i, (t, (shape, dtype)) in enumerate(zip(flat, want)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what} returned carry leaf {i} as {_describe(t)}, expected a tensor of shape "
                                f"{list(shape)} {dtype} (init's leaf {i})")
            if tuple(t.shape) != shape:
                raise ValueError(f"{what} returned carry leaf {i} of shape {list(t.shape)}, expected {list(shape)} "
                                 f"(init's leaf {i}): the carry must keep its shape")
            if t.dtype != dtype:
                raise TypeError(f"{what} returned carry leaf {i} of dtype {t.dtype}, expected {dtype} (init's leaf "
                                f"{i}): the carry must keep its dtype")
        ys = tree_flatten(out[1])[0]
        bad = next((i for i, t in enumerate(ys) if t is not None and not isinstance(t, torch.Tensor)), None)
        if bad is not None:
            raise TypeError(f"{what} returned y with leaf {bad} {_describe(ys[bad])}; expected a pytree of "
                            f"tensors (or None)")
        return out
    return body


def _leaves(tree, what: str):
    flat, spec = tree_flatten(tree)
    if not flat:
        raise ValueError(f"{what}: expected a pytree with at least one XLA tensor, got {tree!r}")
    for i, t in enumerate(flat):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: leaf {i} is a {type(t).__name__}, expected a torch.Tensor")
        if t.device.type != "xla":   # torch_xla: RuntimeError
            raise ScanDeviceError(f"{what}: leaf {i} is on {t.device}, expected a tensor on an XLA device")
    return flat, spec


def _uses_policy(policy: OffloadPolicy) -> bool:
    """False when ``policy`` is the all-device one: the helpers then call torch_xla's functions unchanged."""
    return not (policy.is_all_device and not policy.activations and not policy.remat)


def _check_scan_args(fn, init, xs, partition_fn, is_fn_pure, policy, *, fn_name: str = "fn",
                     pure_name: str = "is_fn_pure"):
    """The argument checks of :func:`scan` / :func:`scan_layers`, before anything is traced.

    Returns ``(policy, flat_xs)``.
    """
    policy = _check_policy(policy)
    check_callable(fn, fn_name, ScanArgumentError)   # torch_xla: ValueError
    check_callable(partition_fn, "partition_fn")
    is_fn_pure = check_bool(is_fn_pure, pure_name)
    _leaves(init, "init")
    flat_xs, _ = _leaves(xs, "xs")
    for i, t in enumerate(flat_xs):
        if t is not None and t.dim() == 0:
            raise ScanArgumentError(f"xs: leaf {i} is 0-d; every tensor of xs needs a leading (layer) dimension "
                                    f"to scan over")   # torch_xla: len() of a 0-d tensor, TypeError
    lengths = {t.shape[0] for t in flat_xs if t is not None}
    if not flat_xs or not lengths:
        raise ValueError("xs: expected at least one tensor with a leading (layer) dimension")
    if len(lengths) > 1:
        raise ValueError(f"xs: leaves disagree on the leading dimension: {sorted(lengths)}")
    if 0 in lengths:
        raise ValueError("xs: the leading (layer) dimension is 0; expected at least one layer")
    if _uses_policy(policy):
        if partition_fn is not default_partition:
            raise ValueError(f"partition_fn: {policy} is implemented by xla_swap's own partitioner "
                             f"(policy_partition), so a custom partition_fn cannot be used with it; drop "
                             f"partition_fn, or use the all-device policy")
        if is_fn_pure:
            warnings.warn(f"{pure_name}=True is ignored with {policy}: the policy path traces the function on "
                          f"every call (its partitioner is not cacheable by torch_xla)", UserWarning, stacklevel=3)
    return policy, flat_xs


def scan(fn: Callable, init, xs, partition_fn: Callable = default_partition, is_fn_pure: bool = False, *,
         policy: OffloadPolicy = ALL_DEVICE):
    """Apply ``fn(carry, x) -> (carry, y)`` over the leading dimension of ``xs``, with placement.

    Same contract as ``torch_xla.experimental.scan.scan`` (values, gradients, pytrees of
    tensors for ``init``/``xs``/``y``); see the module docstring for what ``policy`` changes.

    Args:
      fn: the per-iteration function of (carry pytree, x pytree).
      init: carry pytree of XLA tensors.
      xs: pytree of XLA tensors with a common leading dimension L (L >= 1). With
        ``policy.params == "host"`` every leaf is a stacked weight kept in host memory; its
        layer dimension (0) must not be sharded.
      partition_fn: AOTAutograd partitioner, used as-is with the all-device policy. Any
        other policy is implemented by :func:`policy_partition` (it must insert the swaps),
        so a custom ``partition_fn`` is refused there.
      is_fn_pure: as in torch_xla (enables its tracing cache); with a policy other than the
        all-device one it is ignored, with a ``UserWarning``.
      policy: an :class:`~xla_swap.planning.OffloadPolicy`.

    Returns:
      ``(final_carry, ys)`` exactly as torch_xla's scan.

    Raises (all before anything is traced, except the last ValueError):
      ScanArgumentError (a ``TypeError`` and a ``ValueError``, as torch_xla raises ``ValueError`` for
        the first and ``TypeError`` for the second): ``fn`` is not callable; a leaf of ``xs`` is 0-d.
      ScanDeviceError (a ``TypeError`` and a ``RuntimeError``, torch_xla's type there): a leaf of
        ``init``/``xs`` is a tensor on another device than XLA.
      TypeError: ``partition_fn`` is not callable; ``is_fn_pure`` is not a bool;
        ``policy`` is not an OffloadPolicy; a leaf of ``init``/``xs`` is not a tensor.
      ValueError (torch_xla's type where it raises): ``init`` has no tensor; ``xs`` is empty, has
        a zero-length or disagreeing leading dimension; a custom ``partition_fn`` with a non-all-device policy; a stacked weight
        is sharded along the layer dimension; the policy names an activation no
        ``offload_name`` tagged (raised while tracing).

    Raised while tracing ``fn`` with a policy other than the all-device one (with that one,
    torch_xla's ``scan`` runs unchanged and raises its own errors), naming ``fn`` and what it returned:
      ScanArgumentError: ``fn`` returns something other than a ``(carry, y)`` tuple or list.
      ValueError: the returned carry's structure or a leaf's shape differs from ``init``'s.
      TypeError: a carry leaf's dtype differs from ``init``'s; a leaf of the carry or of ``y`` is
        not a tensor.
    """
    policy, flat_xs = _check_scan_args(fn, init, xs, partition_fn, is_fn_pure, policy)
    if not _uses_policy(policy):
        return _txs.scan(fn, init, xs, partition_fn=partition_fn, is_fn_pure=is_fn_pure)
    return _policy_scan(fn, init, xs, flat_xs, policy, f"fn: {describe_fn(fn)}")


def _policy_scan(fn, init, xs, flat_xs, policy: OffloadPolicy, what: str):
    """torch_xla's scan of ``fn`` under ``policy`` (not the all-device one), its body's output checked."""
    fn = _checked_body(fn, init, what)
    if policy.swaps_params:
        shardings = [slice_sharding(_ctx.sharding_spec(t)) if t is not None else None
                     for t in flat_xs]
        grad_to_host = policy.grads == "host"
        user_fn = fn

        def fn(carry, x):
            flat, spec = tree_flatten(x)
            flat = [place_to_device(t, sh, grad_to_host) if t is not None else None
                    for t, sh in zip(flat, shardings)]
            return user_fn(carry, tree_unflatten(flat, spec))

    return _txs.scan(fn, init, xs, partition_fn=policy_partition(policy), is_fn_pure=False)


def scan_layers(layers, input_data, partition_fn: Callable = default_partition, is_layer_pure: bool = False, *,
                policy: OffloadPolicy = ALL_DEVICE):
    """Run ``layers`` in sequence on ``input_data`` as one scan, like torch_xla's ``scan_layers``.

    The layers' parameters and buffers are stacked (``torch.stack`` inside the graph, as
    torch_xla does) and scanned with :func:`scan` under ``policy``. For weights that stay in
    host memory between steps, keep them stacked yourself and call :func:`scan` (the stack
    of separate layer tensors is itself a device computation).

    Args:
      layers: non-empty sequence of ``nn.Module`` with identical parameter names and shapes.
      input_data: the first layer's input (XLA tensor or pytree).
      partition_fn, is_layer_pure: as in torch_xla.
      policy: an :class:`~xla_swap.planning.OffloadPolicy`.

    Returns:
      The last layer's output; ``input_data`` itself when ``layers`` is empty (as torch_xla).

    Raises:
      ValueError: the layers' parameter names or shapes differ (the message names the layer
        index and the parameter); a custom ``partition_fn`` with a policy other than the
        all-device one; with such a policy, a layer changes the shape of its input (and
        ``TypeError`` for its dtype), raised while tracing.
      ScanDeviceError (a ``TypeError`` and a ``RuntimeError``, torch_xla's type there): a leaf of
        ``input_data`` is a tensor on another device than XLA.
      TypeError: ``layers`` is not a sequence of ``torch.nn.Module`` (the message names
        ``layers[i]``); ``policy`` is not an OffloadPolicy; ``partition_fn`` is not
        callable; ``is_layer_pure`` is not a bool; a leaf of ``input_data`` is not a tensor.
    """
    policy = _check_policy(policy)
    if isinstance(layers, (torch.nn.Module, str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers: expected a sequence of torch.nn.Module, got {type(layers).__name__}")
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise TypeError(f"layers[{i}]: expected a torch.nn.Module, got {type(layer).__name__}")
    check_callable(partition_fn, "partition_fn")
    check_bool(is_layer_pure, "is_layer_pure")
    _leaves(input_data, "input_data")
    if _uses_policy(policy) and partition_fn is not default_partition:
        raise ValueError(f"partition_fn: {policy} is implemented by xla_swap's own partitioner "
                         f"(policy_partition), so a custom partition_fn cannot be used with it")
    if not layers:
        return input_data   # as torch_xla's scan_layers (and torch.nn.Sequential()): no layer, the input
    if is_layer_pure and _uses_policy(policy):
        warnings.warn(f"is_layer_pure=True is ignored with {policy}: the policy path traces the layer on every "
                      f"call", UserWarning, stacklevel=2)
    if not _uses_policy(policy):
        from torch_xla.experimental.scan_layers import scan_layers as _sl
        return _sl(layers, input_data, partition_fn=partition_fn, is_layer_pure=is_layer_pure)
    pb = [_ctx.layer_weights_and_buffers(layer) for layer in layers]
    for which, dicts in (("parameters", [p for p, _ in pb]), ("buffers", [b for _, b in pb])):
        try:
            _ctx.ensure_same_structure(dicts)
        except ValueError as e:
            raise ValueError(f"layers: {which} differ between layers: {e}") from None
    stacked = tree_map(lambda *ts: torch.stack(ts, dim=0), *[(p, b) for p, b in pb])
    one_layer = _ctx.one_layer_fn(layers[0])
    _, flat_xs = _check_scan_args(one_layer, input_data, stacked, default_partition, False, policy)
    carry, _ = _policy_scan(one_layer, input_data, stacked, flat_xs, policy, f"layers: {type(layers[0]).__name__}")
    return carry
