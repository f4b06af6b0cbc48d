"""``benchmarks/host_put_gpu.py`` on virtual CPU devices: every path puts the leaf where it is asked
(values, sharding and memory kind checked here on the same helpers), and the script writes its table."""
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "host_put_gpu.py"
_spec = importlib.util.spec_from_file_location("xla_swap_bench_host_put", _PATH)
host_put = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_put)


def test_the_script_times_every_cpu_path_at_one_and_every_device(tmp_path, num_devices):
    out = tmp_path / "host_put.json"
    assert host_put.main(["--cpu-smoke", "--reps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["n"], r["split"]) for r in rows} == {(n, s) for n in {1, num_devices} for s in ("rows", "cols")}
    for r in rows:
        assert all(r[k] > 0 for k in ("numpy_to_pinned", "numpy_via_device", "zeros_program"))
        assert "cuda_via_dlpack" not in r   # no GPU here


def test_the_zeros_program_and_the_device_path_land_in_pinned_host_with_the_values():
    devs = jax.devices()
    host = NamedSharding(Mesh(np.array(devs), ("d",)), P(None, "d"), memory_kind="pinned_host")
    a = np.asarray(np.arange(8 * 4 * len(devs), dtype=np.float32).reshape(8, -1), jnp.bfloat16)
    via = jax.device_put(jax.device_put(a, host.with_memory_kind("device")), host)
    zeros = jax.jit(lambda: jnp.zeros(a.shape, jnp.bfloat16), out_shardings=host)()
    for x, want in ((via, a), (zeros, np.zeros_like(a))):
        assert x.sharding == host and x.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(x), want)
