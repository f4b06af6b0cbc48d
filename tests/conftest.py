"""Test set-up: virtual CPU devices for torch_xla and JAX, set before either is imported.

The device count comes from ``XLA_SWAP_NUM_DEVICES`` (default 4); ``make test`` runs the
whole suite with 4 devices and the tests marked ``spmd`` again with 1 and 8.
"""
import os

NUM_DEVICES = int(os.environ.get("XLA_SWAP_NUM_DEVICES", "4"))
os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = str(NUM_DEVICES)
_flag = f"--xla_force_host_platform_device_count={NUM_DEVICES}"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def num_devices() -> int:
    """The number of virtual CPU devices of this test run."""
    return NUM_DEVICES
