"""bench/burst.py on CPU: a burst waits out its idle time before it times its calls, and the script prints one line
per row with one cell per implementation."""
import time

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture(scope="module")
def burst(bench_script):
    with bench_script("burst.py", "flashjax_burst") as module:  # it imports bench.py from its own folder
        yield module


def test_burst_seconds_idles_first_and_times_per_call(burst):
    fn = jax.jit(lambda x: jnp.tanh(x) * 2.0)
    calls = [(jnp.ones((64, 64)),), (jnp.zeros((64, 64)),)]
    fn(*calls[0]).block_until_ready()
    start = time.perf_counter()
    per_call = burst.burst_seconds(fn, calls, reps=4, idle=0.2)
    elapsed = time.perf_counter() - start
    assert elapsed >= 0.2
    assert 0 < per_call < (elapsed - 0.2 + 1e-3)  # the idle time is not counted in the calls


def test_main_prints_a_cell_per_implementation(burst, capsys):
    burst.main(["--tokens", "128", "--hidden", "128", "--seqlens", "128", "--rows", "^d64-s128-full$",
                "--impls", "xla,flashjax", "--bursts", "1", "--idle", "0", "--burst-ms", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["row", "xla", "flashjax"]
    row = lines[-1].split()
    assert row[0] == "d64-s128-full" and len(row) == 3 and all(float(cell) > 0 for cell in row[1:])
