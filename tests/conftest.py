"""Test set-up: virtual CPU devices for torch_xla and JAX, set before either is imported.

The device count comes from ``XLA_SWAP_NUM_DEVICES`` (default 4); ``make test`` runs the
whole suite with 4 devices and the tests marked ``spmd`` again with 1 and 8. jax's persistent
compilation cache is on, in ``.cache/jax`` (a test that counts compilations turns it off), and XLA:CPU
compiles at LLVM optimisation level 1 (``FAST_COMPILE_FLAGS``; ``XLA_FLAGS`` naming a level keeps its own) and,
with jaxlib 0.10, with its elemental emitters (``--xla_cpu_use_fusion_emitters=false``); transformers skips torch_xla
in the subprocesses (``USE_TORCH_XLA=0``);
torch runs one intra-op thread (``OMP_NUM_THREADS``, unless set).
``make test`` runs pytest on pytest-xdist workers (``-n auto``): each worker is a process of its own
that runs this file first, so the devices, the environment and jax's counters are per worker; the
cache directory is shared by the workers and the subprocesses the tests start. Every test starts from
the same random state (``seeded_random_state``), whichever tests ran before it in its worker.
"""
import os
import random
import sys

NUM_DEVICES = int(os.environ.get("XLA_SWAP_NUM_DEVICES", "4"))
os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = str(NUM_DEVICES)
#: XLA flags of every test process, and of the subprocesses the tests start (below).
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true"
_flag = f"--xla_force_host_platform_device_count={NUM_DEVICES}"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# XLA:CPU with LLVM's cheap optimisations only (level 1, the expensive passes off): the suite's programs are
# small, so compiling them costs more than running them (half of the model tests' time at the default level;
# level 0 compiles no faster than 1 and runs the decode loops slower). HLO's passes run as before; where
# XLA_FLAGS sets an optimisation level already, it is kept. Subprocesses inherit XLA_FLAGS (those that set
# their own device count keep the other flags: ``XLA_FLAGS`` less ``xla_force_host_platform_device_count``).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE_FLAGS


def _jaxlib_before_0_11() -> bool:
    """Whether the installed jaxlib is older than 0.11 (read from its metadata: jax is not imported yet)."""
    from importlib import metadata
    try:
        major, minor = (int(p) for p in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) < (0, 11)


# XLA:CPU's elemental emitters rather than its newer MLIR fusion emitters, where jaxlib still has them (0.10;
# 0.11 dropped the flag and refuses it, as XLA does any unknown flag): a third less CPU time for the model tests,
# most of which is compiling. XLA_FLAGS naming the flag keeps its own setting; torch_xla 2.9's XLA accepts it.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and _jaxlib_before_0_11():
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One torch intra-op (OpenMP) thread per test process, and per subprocess: ``make test`` runs a pytest-xdist
# worker per core, and on the suite's tiny tensors torch's threads mostly spin-wait for each other while the
# other workers hold the cores (with 2 threads a model test file took twice the CPU time and wall time).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# accelerate (which transformers imports) imports torch_xla when it is installed, unless USE_TORCH_XLA is 0:
# 1.8 CPU-s of every process that imports transformers (torch_xla pulls in torch's inductor and dynamo).
# The test processes import torch_xla anyway (collecting tests/lowering); the subprocesses the tests start
# (torchrun ranks, host-RSS measurements, the benchmarks' pieces) then skip it. What uses torch_xla imports it.
os.environ.setdefault("USE_TORCH_XLA", "0")
# jax's persistent compilation cache, shared by every test process of a run (subprocesses inherit it):
# the many tests that build the same small models load their executables instead of compiling them
# again. Keys hold the program, jax's version, the devices and the flags; `rm -rf .cache/jax` clears it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def num_devices() -> int:
    """The number of virtual CPU devices of this test run."""
    return NUM_DEVICES


@pytest.fixture(autouse=True)
def seeded_random_state():
    """Seed Python's, numpy's and torch's global generators (0) before each test, where its modules use
    them: a test's random inputs do not depend on which tests ran before it in the same process (the
    workers of ``make test`` run modules in any order)."""
    random.seed(0)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)
    if "torch" in sys.modules:   # the CPU generator (torch.manual_seed also visits every device backend)
        sys.modules["torch"].random.default_generator.manual_seed(0)
    yield


#: Modules whose tests start processes of their own or run longest (torchrun ranks, host-RSS measurements,
#: the examples' training runs): collected first, so that ``make test``'s xdist workers (``--dist loadfile``
#: hands out modules in collection order) start them early rather than one worker finishing one alone.
LONG_MODULES = ("stack/test_torchrun.py", "hf/test_load_stack.py", "stack/test_multiprocess_checkpoint.py",
                "integration/test_train_decoder.py", "stack/test_multiprocess.py", "integration/test_minilm_demo.py",
                "integration/test_examples.py")


def pytest_collection_modifyitems(config, items):
    """Move the tests of :data:`LONG_MODULES` to the front, each module's tests in their own order."""
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, m in enumerate(LONG_MODULES) if path.endswith(m)), len(LONG_MODULES))
    items.sort(key=rank)   # stable: every other test keeps its place
