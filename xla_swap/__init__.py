"""xla_swap: run layered models larger than accelerator memory on PyTorch/XLA and JAX.

Layers (each importable on its own; docs/reference/packages.md lists their modules):

* ``xla_swap.lowering``  - the torch_xla lowering front end: lowering, offload annotations, scan helpers.
* ``xla_swap.planning``  - framework-neutral: placement policy, planner, HLO inspection.
* ``xla_swap.executors`` - jax only, no torch: ``executors.streaming`` (``StreamingRuntime``),
  ``executors.pjrt`` (``PjrtExecutor``), ``InGraphRuntime`` and what they share.
* ``xla_swap.stack``     - the torch entry point ``SwappedStack`` (torch + torchax + jax, no torch_xla) and its
  parts, also reachable as ``xla_swap.SwappedStack`` (imported on first use), with its setting groups
  ``xla_swap.ParallelConfig``, ``TrainingConfig``, ``AutotuneConfig``, ``CompileConfig`` (``xla_swap.stack.config``).
* ``xla_swap.hf``        - Hugging Face models: ``causal_lm_stages``, mixture of experts, the KV cache and
  generation, and ``load_stack``: a ``SwappedStack`` from a meta-device model and a safetensors
  checkpoint (``xla_swap.load_stack``, imported on first use).
* ``xla_swap.use_compilation_cache`` - jax's persistent compilation cache for the stage
  executables (``xla_swap.executors.compile_cache``, imported on first use).
* ``xla_swap.distributed`` - ``initialize()``: one process per GPU as ``torchrun`` starts them, each
  passing its own batch (imported on first use; ``docs/how-to/torchrun.md``).

This top-level module imports nothing heavy, so ``import xla_swap.planning`` and
``import xla_swap.executors`` work on machines without torch_xla.
"""
__version__ = "0.1.0"


def __getattr__(name):
    """Lazy access to the torch entry point: ``xla_swap.SwappedStack`` imports torch and jax on first use
    (``load_stack``, ``use_compilation_cache`` and the module ``distributed`` likewise)."""
    if name in ("SwappedStack", "causal_lm_stages"):
        from xla_swap.stack import swapped_stack as stack
        return getattr(stack, name)
    if name in ("ParallelConfig", "TrainingConfig", "AutotuneConfig", "CompileConfig"):
        from xla_swap.stack import config as stack_config
        return getattr(stack_config, name)
    if name == "load_stack":
        from xla_swap.hf import loading
        return loading.load_stack
    if name == "distributed":
        import importlib
        return importlib.import_module("xla_swap.distributed")
    if name == "use_compilation_cache":
        from xla_swap.executors import compile_cache
        return compile_cache.use_compilation_cache
    raise AttributeError(f"module 'xla_swap' has no attribute {name!r}")
