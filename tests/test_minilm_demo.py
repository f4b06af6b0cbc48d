"""The main job's PJRT and streaming executors run end to end and pass their checks.

``make demo`` already runs the default mode (torch_xla runtime); these run
``examples/minilm_embed.py --executor pjrt --params host`` and ``--executor streaming`` as
subprocesses (4 virtual CPU devices), each in well under a minute on 2 cores.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "minilm_embed.py"
COSINE = "[PASS] min cosine vs sentence-transformers >= 0.9999"


def _run(*args: str) -> str:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4",
               XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(args)} exited {r.returncode}:\n{out[-4000:]}"
    assert "[FAIL]" not in out, out[-4000:]
    assert COSINE in r.stdout, r.stdout[-4000:]
    return r.stdout


def test_pjrt_executor_with_host_weights():
    out = _run("--executor", "pjrt", "--params", "host")
    for line in ("[PASS] stacked layer weights are in pinned_host memory",
                 "[PASS] 0 host transfers while lowering and running",
                 "[PASS] layer weights sharded over the mesh"):
        assert line in out, out[-4000:]
    assert "PJRT memory report" in out and "pinned_host" in out


def test_streaming_executor():
    out = _run("--executor", "streaming")
    for line in ("[PASS] streaming: at most k+1 layers' weights on the device",
                 "[PASS] streaming: layer weights resident in pinned_host"):
        assert line in out, out[-4000:]


def test_jax_encoder_layer_matches_torch():
    """The jax layer of the streaming path computes minilm.encoder_layer (random weights, padding)."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import minilm
        import minilm_pjrt
    finally:
        sys.path.remove(str(ROOT / "examples"))
    g = torch.Generator().manual_seed(0)
    hid, inter, b, s = 48, 96, 2, 5
    shapes = {"q_w": (hid, hid), "k_w": (hid, hid), "v_w": (hid, hid), "o_w": (hid, hid), "i_w": (inter, hid),
              "f_w": (hid, inter), "q_b": (hid,), "k_b": (hid,), "v_b": (hid,), "o_b": (hid,), "i_b": (inter,),
              "f_b": (hid,), "ln1_w": (hid,), "ln1_b": (hid,), "ln2_w": (hid,), "ln2_b": (hid,)}
    w = {k: torch.randn(*v, generator=g) * 0.2 for k, v in shapes.items()}
    h = torch.randn(b, s, hid, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    bias = minilm.mask_bias(mask)
    ref = minilm.encoder_layer(h, w, bias, num_heads=4).numpy()
    got = minilm_pjrt.encoder_layer_jax({k: v.numpy() for k, v in w.items()}, h.numpy(), bias.numpy(), num_heads=4)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)
    # the packed-activation stage passes the mask channel through unchanged
    stage = minilm_pjrt._make_stage(4, 1e-12)
    x = np.concatenate([h.numpy(), mask.numpy()[..., None].astype(np.float32)], axis=-1)
    y = np.asarray(stage({k: v.numpy() for k, v in w.items()}, x))
    np.testing.assert_allclose(y[..., :-1], ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(y[..., -1], x[..., -1])
