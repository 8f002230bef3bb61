"""Predicted against measured step time of every layout in a run.py result (default results.json), one panel per
rank count.

python benchmarks/planner/plot.py [results.json] [planner.png]      # needs the `bench` extra (matplotlib)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FormatStrFormatter  # noqa: E402

HERE = Path(__file__).resolve().parent


def main(src: Path, dst: Path) -> None:
    result = json.loads(src.read_text())
    summaries = {s["ranks"]: s for s in result["summary"]}
    fig, axes = plt.subplots(1, len(summaries), figsize=(5.5 * len(summaries), 5), squeeze=False)
    for ax, (world, s) in zip(axes[0], sorted(summaries.items())):
        rows = [r for r in result["layouts"] if r["ranks"] == world]
        for mode, marker in (("fsdp", "o"), ("ddp", "s"), ("zero1", "^")):
            pts = [r for r in rows if r["dp_mode"] == mode]
            ax.scatter(
                [r["predicted_s"] for r in pts], [r["measured_s"] for r in pts], marker=marker, alpha=0.7, label=mode
            )
        chosen = rows[0]
        ax.scatter(
            [chosen["predicted_s"]],
            [chosen["measured_s"]],
            s=200,
            facecolors="none",
            edgecolors="red",
            label=f"chosen {chosen['dp']},{chosen['tp']},{chosen['pp']} m={chosen['micro_batch']}",
        )
        lo = min(min(r["predicted_s"], r["measured_s"]) for r in rows) * 0.9
        hi = max(max(r["predicted_s"], r["measured_s"]) for r in rows) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="predicted s/step",
            ylabel="measured s/step",
            title=f"{world} ranks: chosen/best finalist {s['chosen_over_best']:.2f}, Spearman {s['spearman']:.2f}",
        )
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(FormatStrFormatter("%g"))
            axis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.legend(fontsize=8)
    profile = "calibrated just before the run" if result.get("calibrated") else result["hardware"]
    fig.suptitle(
        f"{result['model']}, batch {result['global_batch']} x {result['seq_len']}, "
        f"{len(result['layouts'])} layouts, profile {profile}"
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main(
        Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results.json",
        Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "planner.png",
    )
