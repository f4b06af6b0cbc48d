"""torch_xla front end: lowering, host-offload annotation ops, scan helpers with a placement policy."""
from xla_swap.lowering._checks import ScanArgumentError, ScanDeviceError
from xla_swap.lowering.computation import (HloParameter, HostTransferError, LoweredComputation, host_transfer_guard,
                                           lower, lower_fn)
from xla_swap.lowering.offload import (emit_annotations, lowering_scope, offload_name, place_to_device, place_to_host,
                                       runtime_supports_annotations)
from xla_swap.lowering.scan import policy_partition, scan, scan_layers

__all__ = ["HloParameter", "HostTransferError", "LoweredComputation", "host_transfer_guard", "lower", "lower_fn",
           "emit_annotations", "lowering_scope", "offload_name", "place_to_device", "place_to_host",
           "runtime_supports_annotations",
           "policy_partition", "scan", "scan_layers", "ScanArgumentError",
           "ScanDeviceError"]
