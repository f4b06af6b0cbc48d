"""Tests that span the layers, or the repository as a whole: front end -> executor (torch_xla-lowered
scans run on the PJRT executor, ``test_scan_pjrt.py``; the planner's prediction against the executor's
memory report, ``test_planner_vs_executor.py``), the examples and the demo (``test_examples.py``,
``test_minilm_demo.py``, ``test_train_decoder.py``), the import layering (``test_layering.py``) and that
the repository stands alone (``test_standalone.py``).

The tests of one package sit beside: ``tests/stack`` (``SwappedStack`` against torch, several processes,
``torchrun``), ``tests/hf`` (families, generation, loading, PEFT), ``tests/executors``, ``tests/planning``,
``tests/lowering``; ``tests/benchmarks_on_cpu`` runs the benchmarks' scripts tiny on the CPU.

Shared helpers here, on every test's path (``pyproject.toml``): ``llama_cases.py`` (the small Llama, its
loss, batches, param groups, schedule), ``ffn_cases.py``, ``transformers_ends.py``. No fixtures of its own.
"""
