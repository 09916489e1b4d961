"""PNG plot of a bench.py report: TFLOP/s against sequence length per head dim, plus the extra rows as bars.

    python bench/plot.py bench.json bench.png      # re-plot a saved report
"""
import json
import sys

STYLE = {"cudnn": ("tab:blue", "o"), "xla": ("tab:gray", "s"), "pallas": ("tab:green", "^"),
         "fa3": ("tab:purple", "v"), "fa3kv": ("tab:pink", "^"), "flashjax": ("tab:red", "D")}


def is_grid_row(row):
    """The S x D x causal grid: plain MHA, Sq == Sk, no window. Everything else (GQA, windows, decode) is extra."""
    return row["heads_q"] == row["heads_k"] and row["seqlen_q"] == row["seqlen_k"] and list(row["window"]) == [-1, -1]


def tflops(entry, direction, impl):
    """(TFLOP/s, failed the correctness check?) or None when the cell was n/a or not run."""
    r = entry["results"].get(direction, {}).get(impl, {})
    return (r["tflops"], r.get("wrong", False)) if "tflops" in r else None


def plot_grid_panel(ax, entries, direction, impls):
    for impl in impls:
        for causal, style in ((False, "-"), (True, "--")):
            pts = sorted((e["row"]["seqlen_q"], *v) for e in entries if e["row"]["causal"] == causal
                         for v in [tflops(e, direction, impl)] if v)
            if not pts:
                continue
            color, marker = STYLE[impl]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker=marker,
                    label=f"{impl} {'causal' if causal else 'full'}")
            wrong = [p for p in pts if p[2]]
            ax.scatter([p[0] for p in wrong], [p[1] for p in wrong], s=150, facecolors="none",
                       edgecolors="black", linewidths=2, zorder=3)
    seqlens = sorted({e["row"]["seqlen_q"] for e in entries})
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
    ax.minorticks_off()
    ax.set_xlabel("sequence length (dashed: causal)")


def plot_extra_panel(ax, entries, direction, impls):
    width = 0.8 / max(len(impls), 1)
    for k, impl in enumerate(impls):
        xs, ys, wrong = [], [], []
        for x, e in enumerate(entries):
            v = tflops(e, direction, impl)
            if v:
                xs.append(x + k * width)
                ys.append(v[0])
                wrong.append(v[1])
        bars = ax.bar(xs, ys, width, label=impl, color=STYLE[impl][0])
        for bar, w in zip(bars, wrong):
            bar.set_hatch("xx" if w else None)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(entries))])
    ax.set_xticklabels([e["row"]["name"] for e in entries], rotation=30, ha="right", fontsize=7)


def write_plot(report, path):
    import matplotlib
    matplotlib.use("Agg")  # headless device machine
    import matplotlib.pyplot as plt

    impls, dirs = report["impls"], report["dirs"]
    grid = [e for e in report["rows"] if is_grid_row(e["row"])]
    extra = [e for e in report["rows"] if not is_grid_row(e["row"])]
    head_dims = sorted({e["row"]["head_dim"] for e in grid})
    cols = len(head_dims) + (1 if extra else 0)
    if not cols:
        return
    fig, axes = plt.subplots(len(dirs), cols, figsize=(4.5 * cols, 3.8 * len(dirs)), squeeze=False)
    for r, direction in enumerate(dirs):
        for c, d in enumerate(head_dims):
            plot_grid_panel(axes[r][c], [e for e in grid if e["row"]["head_dim"] == d], direction, impls)
            axes[r][c].set_title(f"{direction}, head dim {d}")
        if extra:
            plot_extra_panel(axes[r][-1], extra, direction, impls)
            axes[r][-1].set_title(f"{direction}, other shapes")
        axes[r][0].set_ylabel("TFLOP/s")
        for ax in axes[r]:
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=7)
    if extra:
        axes[0][-1].legend(fontsize=7)
    limit = report["rel_err_limit"]
    fig.suptitle(f"{report['device']}, jax {report['jax']}  (black ring, hatched bar: output off by > {limit:g})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        write_plot(json.load(f), sys.argv[2])
