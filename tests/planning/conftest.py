"""Tests of ``xla_swap.planning``: the offload planner and ``OffloadPolicy``; pure Python,
no torch, torch_xla or jax needed. No fixtures of its own.
"""
