"""Draw the loaders' throughput side by side, from recorded ``bench.cpu_loader`` and
``bench.dali_cpu`` runs: one bar per loader at its median samples/s over rounds, the line through
it spanning the slowest and the fastest round.

    .venv/bin/python -m bench.plot_throughput          # docs/assets/loader_throughput.png

Reads ``bench/results/cpu_loader.json`` and ``bench/results/dali_cpu.json`` (the current results,
see ``bench/results/README.md``); plots with matplotlib (installed by ``scripts/setup.sh``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DEFAULT_OUT = REPO / "docs" / "assets" / "loader_throughput.png"
#: (results file, panel title, [(loader key, bar label)]) in the order drawn
PANELS = (
    ("cpu_loader.json", "feedgpu's Python engine against torch's DataLoader",
     [("torch_pillow", "torch + stock Pillow"), ("torch_pillow_simd", "torch + Pillow-SIMD"),
      ("feedgpu", "feedgpu, Python engine")]),
    ("dali_cpu.json", "DALI's CPU operators, the same pipeline",
     [("torch_pillow", "torch + stock Pillow"), ("dali_hand_roi_decode", "hand-written DALI"),
      ("feedgpu_dali_cpu", "feedgpu, DALI engine"), ("feedgpu_python", "feedgpu, Python engine")]),
)
FEEDGPU, OTHER = "#1f4e9c", "#9a9a9a"


def plot(out: Path, results: Path = RESULTS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11, "axes.titlesize": 11.5})
    heights = [len(loaders) for _, _, loaders in PANELS]
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8.4, 0.55 * sum(heights) + 1.6 * len(PANELS)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, title, loaders) in zip(axes[:, 0], PANELS):
        doc = json.loads((results / name).read_text())
        summary = doc["summary"]
        labels, medians, lows, highs = [], [], [], []
        for key, label in loaders:
            s = summary[key]
            runs = s["samples_per_s_runs"]
            labels.append(label)
            medians.append(s["samples_per_s"])
            lows.append(s["samples_per_s"] - min(runs))
            highs.append(max(runs) - s["samples_per_s"])
        y = range(len(labels))
        colours = [FEEDGPU if label.startswith("feedgpu") else OTHER for label in labels]
        ax.barh(list(y), medians, xerr=[lows, highs], color=colours, capsize=3, height=0.6)
        for i, m in zip(y, medians):
            ax.text(m * 0.02, i, f"{m:,.0f}/s", va="center", ha="left", color="white", fontsize=10,
                    fontweight="bold")
        ax.set_yticks(list(y), labels)
        ax.invert_yaxis()
        ax.set_xlabel("samples/s: median of the rounds; the line spans the slowest and the fastest round",
                      fontsize=9.5)
        ax.set_title(f"{title}\n{name.removesuffix('.json')}, {doc['created'][:10]}: "
                     f"{doc['settings'].get('rounds', '?')} rounds, {doc['machine'].get('cpu_count', '?')} CPUs, "
                     f"{doc['settings'].get('workers', '?')} workers, batch {doc['settings'].get('batch_size', '?')}",
                     fontsize=10.5)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the results files")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the PNG to write")
    a = ap.parse_args(argv)
    print(plot(a.out, a.results))


if __name__ == "__main__":
    main()
