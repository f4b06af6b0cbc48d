"""``benchmarks/host_overhead_cpu.py``: the call it times is the stack's forward, equal to the torch layers'
own forward (bf16, the same weights), and its timing loop returns a time per call."""
import jax
import numpy as np
import torch

import host_overhead_cpu as ho  # benchmarks/ is on pytest's pythonpath


def test_timed_call_equals_torch_and_is_timed():
    st, mods = ho.build(3)
    x = np.random.default_rng(1).standard_normal((ho.T, ho.D)).astype(np.float32)
    got = ho.the_call(st, jax.device_put(x.astype(jax.numpy.bfloat16)))
    h = torch.from_numpy(x).to(torch.bfloat16)
    with torch.no_grad():
        for m in mods:
            h = m(h)
    assert isinstance(got, torch.Tensor) and got.shape == (ho.T, ho.D)
    torch.testing.assert_close(got.float(), h.float(), rtol=2e-2, atol=2e-2)
    assert ho.per_call_us(2, windows=1, calls=2, warmup=1) > 0
