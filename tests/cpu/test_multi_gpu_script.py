"""bench/multi_gpu.py end to end on virtual CPU devices (8, 2 and 1), as the lead runs it on GPUs (issue 42).

Each run is its own process (the device count is fixed when JAX starts), started together so that their compiles
share the two cores; the JSON of each must say every check passed and hold every field the docs promise. A run whose
check limits no output can meet must exit 1.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "multi_gpu.py"
COUNTS = (8, 2, 1)
CHECK_FIELDS = ("out", "dq", "dk", "dv")
SHARDED_TIMING = ("ms_sharded", "ms_share", "ms_whole", "flops", "tflops_per_device", "tflops_share", "tflops_whole",
                  "efficiency_vs_share", "efficiency_vs_whole")
RING_TIMING = ("ms", "flops", "tflops_per_device", "ms_single", "tflops_single", "fraction_of_single",
               "ms_nocomm_probe", "tflops_per_device_nocomm_probe", "ring_over_nocomm", "async_transfers",
               "transfers_overlapping_compute")
# A driver that runs the script's main with limits no output meets (errors are >= 0), and exits as the script does.
FAILING_DRIVER = ("import sys; sys.path.insert(0, sys.argv[1]); import multi_gpu as m; "
                  "m.LIMITS['float32'] = (-1.0, -1.0); sys.exit(0 if m.main(sys.argv[2:])['checks_passed'] else 1)")


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{count: (return code, output, report)} of --smoke runs on 8, 2 and 1 CPU devices, and "failing": the same
    on one device with unmeetable limits."""
    out = tmp_path_factory.mktemp("multi_gpu")
    commands = {n: [sys.executable, str(SCRIPT), "--smoke", "--cpu-devices", str(n), "--json", str(out / f"{n}.json")]
                for n in COUNTS}
    commands["failing"] = [sys.executable, "-c", FAILING_DRIVER, str(SCRIPT.parent), "--smoke", "--cpu-devices", "1",
                           "--parts", "a", "--json", str(out / "failing.json")]
    procs = {key: subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True) for key, cmd in commands.items()}
    results = {}
    for key, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        path = out / f"{key}.json"
        results[key] = (proc.returncode, output, json.loads(path.read_text()) if path.exists() else None)
    return results


@pytest.mark.parametrize("count", COUNTS)
def test_every_check_passes_and_the_run_exits_zero(runs, count):
    code, output, report = runs[count]
    assert code == 0, output
    assert report["checks_passed"] is True
    assert report["devices"] == count and report["platform"] == "cpu" and report["smoke"] is True
    rows = report["sharded"] + report["ring"]
    assert rows and all(r["check"]["passed"] and "error" not in r for r in rows)
    assert output.rstrip().endswith("checks: all passed")  # the table comes last


def _finite_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _assert_check(check, dtype):
    limit_out, limit_grad = {"float32": (1e-4, 2e-4)}[dtype]
    for name in CHECK_FIELDS:
        entry = check[name]
        assert _finite_number(entry["rel"]) and _finite_number(entry["max_abs"]), (name, entry)
        assert 0 <= entry["rel"] <= entry["limit"] == (limit_out if name == "out" else limit_grad), (name, entry)


@pytest.mark.parametrize("count", COUNTS)
def test_sharded_part_has_every_split_and_field(runs, count):
    report = runs[count][2]
    splits = ["batch", "heads"] + (["batch+heads"] if count == 8 else [])
    rows = report["sharded"]
    assert sorted({r["config"]["split"] for r in rows}) == sorted(splits)
    for split in splits:
        mine = [r for r in rows if r["config"]["split"] == split]
        checks = [r for r in mine if r["kind"] == "check"]
        timed = [r for r in mine if r["kind"] == "timed"]
        assert len(checks) == 1 and checks[0]["timing"] is None
        ragged = checks[0]["config"]
        assert ragged["seqlen_q"] != ragged["seqlen_k"] and ragged["heads_q"] > ragged["heads_k"]  # GQA, Sq != Sk
        assert sorted(r["config"]["causal"] for r in timed) == [False, True]
        for r in mine:
            _assert_check(r["check"], report["dtype"])
        for r in timed:
            timing, config = r["timing"], r["config"]
            assert all(_finite_number(timing[k]) and timing[k] > 0 for k in SHARDED_TIMING), timing
            share = config["share"]
            # The global problem is the mesh's shards of one device's share.
            assert config["batch"] * config["heads_q"] == count * share["batch"] * share["heads_q"]
            assert math.isclose(timing["tflops_per_device"], timing["flops"] / count / timing["ms_sharded"] / 1e9)
            assert math.isclose(timing["efficiency_vs_share"], timing["ms_share"] / timing["ms_sharded"])


@pytest.mark.parametrize("count", COUNTS)
def test_ring_part_has_both_layouts_checked_and_timed(runs, count):
    report = runs[count][2]
    rows = report["ring"]
    for layout, causal in (("zigzag", True), ("contiguous", False)):
        mine = [r for r in rows if r["config"]["layout"] == layout]
        assert all(r["config"]["causal"] == causal for r in mine)
        checks = [r for r in mine if r["kind"] == "check"]
        timed = [r for r in mine if r["kind"] == "timed"]
        assert len(checks) == 1 and len(timed) >= 1
        config = checks[0]["config"]
        assert config["seqlen_q"] == count * config["shard_q"] and config["seqlen_q"] != config["seqlen_k"]
        assert config["heads_q"] > config["heads_k"]
        _assert_check(checks[0]["check"], report["dtype"])
        for r in timed:
            timing, config = r["timing"], r["config"]
            assert r["check"] == {"finite": True, "passed": True}
            assert config["shard_q"] * count == config["seqlen_q"]
            assert all(_finite_number(timing[k]) and timing[k] >= 0 for k in RING_TIMING), timing
            assert timing["ms"] > 0 and timing["ms_nocomm_probe"] > 0 and timing["ms_single"] > 0
            assert math.isclose(timing["fraction_of_single"], timing["tflops_per_device"] / timing["tflops_single"])
            # CPU collectives are synchronous: no start/done pairs to overlap.
            assert timing["async_transfers"] == timing["transfers_overlapping_compute"] == 0
            assert timing["meets_goal"] is None and timing["trace"] is None  # shards far below 64k; no --trace
    assert report["ring_goal"] == {"fraction": 0.85, "min_shard": 65536}


def test_a_failed_check_exits_one(runs):
    code, output, report = runs["failing"]
    assert code == 1, output
    assert report["checks_passed"] is False and "ring" not in report
    assert report["sharded"] and not any(r["check"]["passed"] for r in report["sharded"])
    assert "checks: FAILED" in output


@pytest.fixture(scope="module")
def script(bench_script):
    with bench_script("multi_gpu.py", "flashjax_multi_gpu") as module:
        module.import_jax()
        yield module


def test_errors_flag_wrong_nan_and_misshaped_outputs(script):
    want = tuple(jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(4, 16) + i for i in range(4))
    assert script.errors_against(want, want, "float32")["passed"]
    off = (want[0] * 1.005,) + want[1:]
    report = script.errors_against(off, want, "float32")
    assert not report["passed"] and report["out"]["rel"] > report["out"]["limit"]
    assert script.errors_against(off, want, "bfloat16")["passed"]  # 0.5% is within bf16's 1e-2 on out
    nan = want[:3] + (want[3].at[0, 0].set(jnp.nan),)
    assert not script.errors_against(nan, want, "bfloat16")["passed"]
    assert not script.errors_against(want[:1] + (want[1][:2],) + want[2:], want, "float32")["passed"]


@pytest.mark.parametrize("argv", [["--parts", "c"], ["--sizes", "b=abc"], ["--sizes", "x=4"], ["--sizes", "a=0"],
                                  ["--cpu-devices", "0"]])
def test_bad_flags_are_refused(script, argv, capsys):
    with pytest.raises(SystemExit) as error:
        script.parse_args(argv)
    assert error.value.code == 2
    assert argv[0] in capsys.readouterr().err
