"""Tests that span the layers, or the repository as a whole:

* the torch entry point ``SwappedStack`` against plain torch (``test_stack.py``), and several
  processes through ``jax.distributed`` (``test_multiprocess.py`` runs ``mp_worker.py``);
* front end -> executor: torch_xla-lowered scans run on the PJRT executor (``test_scan_pjrt.py``),
  the planner's prediction against the executor's memory report (``test_planner_vs_executor.py``);
* the examples and the demo (``test_examples.py``, ``test_minilm_demo.py``,
  ``test_train_decoder.py``) and the benchmarks' CPU checks (``test_gpu_stack_cpu.py``,
  ``test_anchors_cpu.py``);
* the import layering (``test_layering.py``) and that the repository stands alone
  (``test_standalone.py``).

Shared helpers: ``llama_cases.py`` (the small Llama, its loss, batches, param groups, schedule).
No fixtures of its own (``num_devices`` comes from the root conftest).
"""
