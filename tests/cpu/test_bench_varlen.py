"""bench/varlen.py (issue 37's speed rows) on CPU: the padding it gives cuDNN is exact, its FLOP counts follow the
packing, and a shrunken run prints every row (cuDNN n/a here)."""
import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture(scope="module")
def varlen_bench(bench_script):
    with bench_script("varlen.py", "flashjax_bench_varlen") as module:
        yield module


def test_padding_round_trips_and_zero_fills(varlen_bench):
    row = varlen_bench.VarlenRow("t", "pad", (3, 0, 5, 1), heads_q=2, heads_k=2, head_dim=4)
    pad, unpad, lengths = varlen_bench.padded(row)
    x = jax.random.normal(jax.random.key(1), (9, 2, 4))
    padded = pad(x)
    assert padded.shape == (4, 5, 2, 4)
    np.testing.assert_array_equal(unpad(padded), x)
    np.testing.assert_array_equal(padded[2, :5], x[3:8])
    assert float(jnp.abs(padded[0, 3:]).sum()) == 0 and float(jnp.abs(padded[1]).sum()) == 0
    assert lengths.tolist() == [3, 0, 5, 1]


def test_flops_follow_the_packing(varlen_bench):
    pack = varlen_bench.VarlenRow("p", "pack", (4, 0, 2), heads_q=1, heads_k=1, head_dim=8)
    assert pack.flops("fwd") == 4 * 8 * (16 + 4) / 2 and pack.flops("bwd") == 2.5 * pack.flops("fwd")
    decode = varlen_bench.VarlenRow("d", "decode", (10, 6), heads_q=4, heads_k=2, head_dim=8)
    assert decode.queries == (1, 1) and decode.flops("fwd") == 4 * 4 * 8 * 16
    assert decode.kv_bytes() == 2 * 2 * 16 * 2 * 8
    dense = varlen_bench.dense_equal(varlen_bench.VarlenRow("q", "pack", (6, 6, 2, 2)))
    assert (dense.batch, dense.seqlen_q, dense.causal) == (5, 4, True)  # 5 x 4^2 = 80 = 36 + 36 + 4 + 4


def test_shrunken_run_prints_every_row(varlen_bench):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        varlen_bench.main(["--scale", "32", "--trials", "1", "--input-sets", "1", "--reps", "1"])
    text = stdout.getvalue()
    for name in ("pack64-1..1024", "pack1000-0..512", "pad64-1..512", "decode64-1k..32k-gqa32:8"):
        assert name in text
    assert "cost" in text and "cudnn n/a" in text and "of copy" in text
    assert text.count(" bwd ") == 3  # decode is forward only
