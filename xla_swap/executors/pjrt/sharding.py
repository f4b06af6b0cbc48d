"""HLO shardings of the entry parameters of :class:`xla_swap.executors.PjrtExecutor`, and its devices.

* :func:`parse_hlo_sharding`: an HLO sharding string (``"{devices=[4,1]0,1,2,3}"``, as torch_xla
  reports it) as a jaxlib ``HloSharding``, checked (each tile's device named once, in ``0..n-1``);
* :func:`check_rank`, :func:`check_even`: a sharding fits its parameter's shape;
* :func:`parameter_shardings`: each parameter's sharding, requested or the module's own;
* :func:`resolve_devices`: the devices to compile for, checked against those shardings.

Imports jax and numpy only (the private jax / jaxlib APIs through :mod:`xla_swap._compat.jax`).
"""
from __future__ import annotations

import jax

from xla_swap._compat import jax as _cj   # every private jax / jaxlib API used here

from .module import EntryFunction, ModuleSource, str_attr


def parse_hlo_sharding(text: str, where: str):
    """A jaxlib ``HloSharding`` from an HLO sharding string; ValueError naming ``where`` when invalid.

    A tiled sharding over n devices must name each of the device ids ``0..n-1`` once (XLA's
    verifier refuses anything else at compile time).
    """
    try:
        sharding = _cj.parse_hlo_sharding(text)
    except _cj.MissingUpstreamAPI:
        raise
    except Exception as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "error:" in ln), lines[0] if lines else type(e).__name__)
        raise ValueError(f"{where}: invalid HLO sharding string {text!r}: {detail}") from e
    layout = _cj.hlo_sharding_layout(sharding)
    if layout.kind == "tiled":
        ids, n = layout.device_ids, layout.num_devices
        twice = sorted({d for d in ids if ids.count(d) > 1}) if len(set(ids)) != len(ids) else []
        if twice:
            raise ValueError(f"{where}: HLO sharding {text!r} lists device {twice[0]} twice; each device holds "
                             f"one tile")
        bad = [d for d in ids if not 0 <= d < n]
        if bad:
            raise ValueError(f"{where}: HLO sharding {text!r} names device {bad[0]}, but its {n} tiles run on "
                             f"devices 0..{n - 1}")
    return sharding


def devices_needed(hlo_sharding) -> int:
    """Smallest device count the sharding (a jaxlib ``HloSharding``) can run on (0: any)."""
    layout = _cj.hlo_sharding_layout(hlo_sharding)
    if layout.kind == "tiled":
        return layout.num_devices
    if layout.kind == "maximal" and layout.device_ids:
        return max(layout.device_ids) + 1
    return 0


def is_tiled(hlo_sharding) -> bool:
    """Whether a jaxlib ``HloSharding`` splits its array into tiles (not replicated nor maximal)."""
    return _cj.hlo_sharding_layout(hlo_sharding).kind == "tiled"


def check_rank(hlo_sharding, shape: tuple, where: str) -> None:
    """ValueError naming ``where`` when a tiled sharding tiles another number of dimensions than ``shape`` has."""
    layout = _cj.hlo_sharding_layout(hlo_sharding)
    if layout.kind != "tiled":
        return
    if layout.tiled_rank != len(shape):
        raise ValueError(f"{where}: sharding {hlo_sharding} tiles {layout.tiled_rank} dimension(s), but the "
                         f"parameter has rank {len(shape)} (shape {list(shape)})")


def check_even(hlo_sharding, shape: tuple, where: str) -> None:
    """ValueError when a tiled sharding does not split every dimension evenly (jax arrays need that)."""
    layout = _cj.hlo_sharding_layout(hlo_sharding)
    if layout.kind != "tiled":
        return
    tiles = list(layout.tile_dims)[:len(shape)]
    for dim, (size, count) in enumerate(zip(shape, tiles)):
        if count > 1 and size % count:
            raise ValueError(f"{where}: sharding {hlo_sharding} splits dimension {dim} of size {size} into {count} "
                             f"shards, which does not divide it (shape {list(shape)}); jax arrays need even "
                             f"shards: choose a sharding whose shard counts divide the shape")


def parameter_shardings(entry: EntryFunction, shard_specs: list) -> list:
    """Per parameter, its HLO sharding: from the requested spec, else the module's ``mhlo.sharding``, else ``None``.

    Args:
      entry: the entry function (:func:`xla_swap.executors.pjrt.module.read_entry`).
      shard_specs: per parameter, an HLO sharding string, a jax Sharding or None (the module's own).

    Raises: ValueError: an invalid sharding string, or one whose rank differs from the parameter's.
    """
    out = []
    for i, spec in enumerate(shard_specs):
        where = f"placements[{i}]" if spec is not None else f"parameter {i}"
        if isinstance(spec, jax.sharding.Sharding):
            sharding = _cj.sharding_to_hlo(spec, len(entry.metas[i][0]))
        else:
            text = spec if isinstance(spec, str) else str_attr(entry.arg_attrs[i], "mhlo.sharding")
            sharding = parse_hlo_sharding(text, where) if text else None
        if sharding is not None:
            check_rank(sharding, entry.metas[i][0], where)
        out.append(sharding)
    return out


def _module_device_count(source: ModuleSource, entry: EntryFunction, shard_specs: list, hlo_shardings: list) -> int:
    """The device count that the shardings and ``mhlo.num_partitions`` of the module name (0: any)."""
    needed = max([devices_needed(h) for h in hlo_shardings if h is not None] + [0])
    for attrs in entry.res_attrs:
        text = str_attr(attrs, "mhlo.sharding")
        if text:
            needed = max(needed, devices_needed(parse_hlo_sharding(text, "module result")))
    if source.num_partitions and source.num_partitions > 1:
        needed = max(needed, source.num_partitions)
    for spec in shard_specs:
        if isinstance(spec, jax.sharding.Sharding) and not spec.is_fully_replicated:
            needed = max(needed, len(_cj.sharding_devices(spec)))
    return needed


def resolve_devices(source: ModuleSource, entry: EntryFunction, devices, shard_specs: list,
                    hlo_shardings: list) -> tuple:
    """The devices to compile for: ``devices`` checked against the shardings, or the first N of
    ``jax.devices()`` where N is the device count the module's shardings / ``mhlo.num_partitions`` name.

    Raises: ValueError: the device count or order the module cannot use, duplicates, several
      platforms, a sharding that splits a dimension unevenly (messages as ``PjrtExecutor``'s).
    """
    needed = _module_device_count(source, entry, shard_specs, hlo_shardings)
    if devices is None:
        available = jax.devices()
        n = max(needed, 1)
        if n > len(available):
            raise ValueError(f"devices: the module is partitioned over {n} devices, but only "
                             f"{len(available)} {available[0].platform} device(s) are available")
        devices = tuple(available[:n])
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise ValueError(f"devices: expected a non-empty sequence of jax devices, got {devices!r}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices: duplicate devices in {devices}")
    if len({d.platform for d in devices}) != 1:
        raise ValueError(f"devices: all devices must be of one platform, got {devices}")
    n = len(devices)
    if n > len(jax.devices(devices[0].platform)):
        raise ValueError(f"devices: {n} devices given, but only {len(jax.devices(devices[0].platform))} "
                         f"are available")
    if source.num_partitions and source.num_partitions > 1 and n != source.num_partitions:
        raise ValueError(f"devices: the module declares mhlo.num_partitions={source.num_partitions}, "
                         f"but {n} device(s) were given")
    for i, sharding in enumerate(hlo_shardings):
        if sharding is None:
            continue
        count = devices_needed(sharding)
        if is_tiled(sharding) and count != n:
            raise ValueError(f"devices: parameter {i} is sharded {sharding} over {count} devices, but {n} device(s) "
                             f"were given; pass {count} devices")
        if not is_tiled(sharding) and count > n:
            raise ValueError(f"devices: parameter {i} is placed on {sharding}, but only {n} device(s) were given")
        check_even(sharding, entry.metas[i][0], f"placements[{i}]" if shard_specs[i] is not None else f"parameter {i}")
    for i, spec in enumerate(shard_specs):
        if isinstance(spec, jax.sharding.Sharding) and not spec.is_fully_replicated \
                and _cj.sharding_devices(spec) != devices:
            raise ValueError(f"placements[{i}]: the sharding's devices {_cj.sharding_devices(spec)} "
                             f"differ from the executor's devices {devices} (order matters)")
    return devices
