"""Tests of ``xla_swap.lowering``, the torch_xla front end: lowering to a sharded HLO module
with its parameter table, the offload annotations and the policy-driven scan helpers, and the
front end's reliability on bad input; values and gradients against torch_xla's own scan and
plain CPU torch, plus HLO contents.

Helper modules (on pytest's ``pythonpath``, see pyproject.toml): ``xla_util.py`` (SPMD on the
virtual devices, a mesh; also used by integration tests and one executor test) and
``scan_cases.py`` (the scan body, policies and lowered training step). No fixtures of its own.
"""
