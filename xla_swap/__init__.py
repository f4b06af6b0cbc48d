"""xla_swap: run layered models larger than accelerator memory on PyTorch/XLA and JAX.

Layers (each importable on its own):

* ``xla_swap.frontend``  - torch_xla front end: lowering, offload annotations, scan helpers.
* ``xla_swap.planning``  - framework-neutral: placement policy, planner, HLO inspection.
* ``xla_swap.executors`` - PJRT executor and streaming runtime (jax only, no torch).

This top-level module imports nothing heavy, so ``import xla_swap.planning`` and
``import xla_swap.executors`` work on machines without torch_xla.
"""
__version__ = "0.1.0"
