"""Serialize a jax.export of flashjax's forward and backward, lowered for CUDA by the flashjax on PYTHONPATH.

tests/gpu/data/ keeps artifacts made this way by earlier versions; test_kernels.py runs them on today's
library (FFI calls lowered by an older flashjax must keep working). Made on any machine, no GPU needed:
  git archive <commit> python/flashjax | tar -x -C /tmp/old && PYTHONPATH=/tmp/old/python:tests/gpu \\
    python tests/gpu/export_fixture.py tests/gpu/data/flashjax_<version>_fwd_bwd.jax_export
The function: (q, k, v, d_out) -> (out, dq, dk, dv) of causal attention through the primitives, q [2, 300, 8, 128],
k and v [2, 517, 2, 128], bf16, d_out like out; inputs from export_fixture_inputs().
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

SHAPES = ((2, 300, 8, 128), (2, 517, 2, 128), (2, 517, 2, 128), (2, 300, 8, 128))
PARAMS = dict(softmax_scale=128 ** -0.5, softcap=0.0, window_left=-1, window_right=0, has_sinks=False)


def export_fixture_inputs(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in SHAPES)


def fixture_function():
    from flashjax import primitives

    def attention(q, k, v):
        sinks = jnp.zeros((q.shape[2],), jnp.float32)
        return primitives.forward(q, k, v, sinks, **PARAMS)[0]

    def fwd_bwd(q, k, v, d_out):
        out, pullback = jax.vjp(attention, q, k, v)
        return (out, *pullback(d_out))
    return fwd_bwd


def export_call(fn, platforms=None):
    """jax.export of fn with flashjax's FFI targets allowed (jax.export refuses custom calls it does not know)."""
    from flashjax import export_checks
    return export.export(jax.jit(fn), platforms=platforms, disabled_checks=export_checks())


def main(path):
    from flashjax import _ffi
    _ffi.register_targets = lambda: None  # registration serves compilation; lowering for export needs none
    exported = export_call(fixture_function(), platforms=("cuda",))(*export_fixture_inputs())
    serialized = exported.serialize()
    with open(path, "wb") as f:
        f.write(serialized)
    print(f"wrote {path}: {len(serialized)} bytes, platforms {exported.platforms}")


if __name__ == "__main__":
    main(sys.argv[1])
