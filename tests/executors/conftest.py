"""Tests of ``xla_swap.executors``: the streaming runtime, the in-graph runtime and the PJRT
executor, on the virtual CPU devices, against monolithic device-resident jax references;
plus the fuzzing of the executors' (and ``SwappedStack``'s) public entry points.

Shared cases live in ``streaming_cases.py``; the fixtures here are the ones several modules use.
"""
import pytest

from streaming_cases import make_input, make_params


@pytest.fixture(scope="module")
def params():
    """The weights of the ``L``-layer stack (one dict of numpy arrays per layer)."""
    return make_params()


@pytest.fixture(scope="module")
def x():
    """The input of the stack: ``(T, D)`` float32."""
    return make_input()
