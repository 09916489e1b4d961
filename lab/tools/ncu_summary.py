"""Summarizes one Nsight Compute report for kernel work (tools/device_check.sh's ncu stage runs it on the device).

    python lab/tools/ncu_summary.py REPORT.ncu-rep [--top 40]

Prints the kernel's pipe utilizations and warp stall reasons (sampled, summed over the kernel) and the SASS lines
with the most stall samples, each with its leading reasons: where the warps wait, not just how long.
"""
import argparse
import csv
import io
import re
import subprocess
import sys


def ncu(*args):
    """ncu's stdout; empty where ncu is not installed (e.g. reading an exported source page on another machine)."""
    try:
        return subprocess.run(["ncu", *args], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        return ""


def raw_metrics(report):
    rows = list(csv.reader(io.StringIO(ncu("-i", report, "--page", "raw", "--csv"))))
    if len(rows) < 3:
        return {}
    header, values = rows[0], rows[2]  # rows[1] holds the units
    return dict(zip(header, values))


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--source-csv", help="the report's source page, already exported (ncu --page source --csv "
                                             "--print-source sass): read instead of exported again")
    args = parser.parse_args()

    metrics = raw_metrics(args.report)
    print("== pipes (% of peak, active cycles)")
    for name, value in sorted(metrics.items()):
        if re.match(r"sm__(inst_executed_)?pipe_.*pct_of_peak_sustained_active$", name) and (number(value) or 0) > 1:
            print(f"  {name:80s} {value}")
    for name in ("sm__cycles_elapsed.avg.per_second", "gpu__time_duration.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
                 "launch__registers_per_thread"):
        if name in metrics:
            print(f"  {name:80s} {metrics[name]}")

    stalls = {name: number(value) for name, value in metrics.items()
              if name.startswith("smsp__pcsamp_warps_issue_stalled_") and not name.endswith("_not_issued")}
    total = sum(v for v in stalls.values() if v) or 1.0
    print("== warp stall samples by reason (share of all samples)")
    for name, value in sorted(stalls.items(), key=lambda kv: -(kv[1] or 0)):
        if value and value / total >= 0.005:
            print(f"  {name.removeprefix('smsp__pcsamp_warps_issue_stalled_'):40s} {value / total:6.1%}")

    if args.source_csv:
        with open(args.source_csv) as f:
            source_csv(f.read(), args.top)
    else:
        source_csv(ncu("-i", args.report, "--page", "source", "--csv", "--print-source", "sass"), args.top)


def source_csv(text, top):
    """The source page: a "Kernel Name" line, then a header line and one line per SASS instruction."""
    rows = [r for r in csv.reader(io.StringIO(text[text.find('"'):])) if r and r[0] != "Kernel Name"]
    if not rows:
        print("no source page")
        return
    header = rows[0]
    col = {name: i for i, name in enumerate(header)}
    samples_col = next((i for name, i in col.items() if name.startswith("Warp Stall Sampling (All")), None)
    source_col = col.get("Source")
    address_col = col.get("Address")
    if samples_col is None or source_col is None:
        return
    reason_cols = [(name, i) for name, i in col.items() if name.startswith("stall_") and "(" not in name]
    body = [r for r in rows[1:] if len(r) == len(header)]
    all_samples = sum(number(r[samples_col]) or 0 for r in body) or 1.0
    print(f"== top {top} SASS lines by stall samples (of {all_samples:.0f})")
    for r in sorted(body, key=lambda r: -(number(r[samples_col]) or 0))[:top]:
        reasons = sorted(((number(r[i]) or 0, name) for name, i in reason_cols), reverse=True)[:3]
        why = ", ".join(f"{name}={value:.0f}" for value, name in reasons if value)
        print(f"  {r[address_col] if address_col is not None else '':>8} {(number(r[samples_col]) or 0) / all_samples:6.1%}  "
              f"{r[source_col][:60]:60s} {why}")


if __name__ == "__main__":
    sys.exit(main())
