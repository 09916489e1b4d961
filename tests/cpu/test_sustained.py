"""bench/sustained.py on CPU: its nvidia-smi sampling (a stand-in nvidia-smi on PATH) and its parsing."""
import stat
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture(scope="module")
def sustained(bench_script):
    with bench_script("sustained.py", "flashjax_sustained") as module:  # it imports bench.py from its own folder
        yield module


def test_parse_samples_skips_what_was_not_measured(sustained):
    lines = ["1515, 691.20, 0x0000000000000004", "1980, [N/A], 0x0000000000000000", "1560, 688.5",
             "1545, 690.00, 0x0000000000000000"]
    assert sustained.parse_samples(lines) == [(1515.0, 691.2, "0x0000000000000004"),
                                              (1545.0, 690.0, "0x0000000000000000")]


def test_run_sustained_times_calls_and_reads_samples(sustained, tmp_path, monkeypatch):
    # A stand-in nvidia-smi that prints one sample every 10 ms until it is terminated, as `-lms 10` would.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\ni=0\nwhile true; do echo \"$((1500 + i)), 690.5, 0x0000000000000004\"; "
                    "i=$((i + 1)); sleep 0.01; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{Path(sys.executable).parent}:/usr/bin:/bin")
    fn = jax.jit(lambda x: jnp.tanh(x) * 2.0)
    calls = [(jnp.ones((64, 64)),), (jnp.zeros((64, 64)),)]
    rate, samples = sustained.run_sustained(fn, calls, seconds=0.3)
    assert rate > 0
    assert len(samples) >= 5, samples
    assert all(watts == 690.5 and reasons == "0x0000000000000004" for _, watts, reasons in samples)
    clocks = [mhz for mhz, _, _ in samples]
    assert clocks == sorted(clocks) and clocks[0] >= 1500  # in order, the first two lines dropped
