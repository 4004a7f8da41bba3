"""Draw ``num_workers: auto`` finding its worker count, from a recorded ``bench.balancer`` run.

Each panel is one ``auto`` run of one consumer: above, the rate the training loop consumed in each
1 s window, with the medians of the fixed worker counts' runs of the same consumer dashed; below,
the worker count the balancer ran. Reads ``bench/results/balancer_final.json`` by default (the
current result, see ``bench/results/README.md``) and writes the figure the docs show::

    .venv/bin/python -m bench.plot_balancer            # docs/assets/balancer_auto.png
    .venv/bin/python -m bench.plot_balancer --results bench/results/balancer_final_90s.json \\
        --run cnn-all:2 --out /tmp/cnn.png

Plots with matplotlib (installed by ``scripts/setup.sh`` for ``feedgpu bench --plot``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "bench" / "results" / "balancer_final.json"
DEFAULT_OUT = REPO / "docs" / "assets" / "balancer_auto.png"
#: the runs the docs show: a loop that needs less than the cores give (auto frees a core), and a
#: CNN trained on the CPU (auto tries a third worker, measures no gain, goes back)
DEFAULT_RUNS = ("sleep-300:0", "cnn-1t:0")
TITLES = {"sleep-300": "a loop that needs 300 samples/s", "sleep-800": "a loop that needs 800 samples/s",
          "sleep-3000": "a loop that needs 3,000 samples/s", "cnn-1t": "a CNN trained on the CPU, 1 thread",
          "cnn-all": "a CNN trained on the CPU, 2 threads", "busy-core": "a loop that keeps one core busy"}


def pick(doc: dict, spec: str) -> tuple[dict, dict]:
    """``(consumer, auto run)`` for ``"consumer:round"``; raises KeyError naming what exists."""
    name, _, index = spec.partition(":")
    consumers = {c["consumer"]: c for c in doc["consumers"]}
    if name not in consumers:
        raise KeyError(f"no consumer {name!r} in the results; there are {sorted(consumers)}")
    runs = consumers[name]["runs"]["auto"]
    return consumers[name], runs[int(index or 0)]


def plot(doc: dict, specs: list[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11, "axes.titlesize": 11.5, "axes.labelsize": 11})
    fig, axes = plt.subplots(2, len(specs), figsize=(4.6 * len(specs), 5.4), sharex="col",
                             gridspec_kw={"height_ratios": [3, 1.2]}, squeeze=False)
    for col, spec in enumerate(specs):
        consumer, run = pick(doc, spec)
        timeline = run["timeline"]
        t = [w["t"] for w in timeline]
        top, bottom = axes[0][col], axes[1][col]
        top.plot(t, [w["rate"] for w in timeline], color="#1f4e9c", lw=1.6, label="auto, each 1 s window")
        medians = consumer["median_samples_per_s"]
        for count, colour in zip(("1", "2", "3"), ("#b0b0b0", "#6a9a3a", "#c0762a")):
            if count in medians:
                top.axhline(medians[count], ls="--", lw=1, color=colour,
                            label=f"{count} worker{'s' if count != '1' else ''} (fixed)")
        top.set_title(TITLES.get(consumer["consumer"], consumer["consumer"]), fontsize=10)
        if col == 0:
            top.set_ylabel("samples/s trained")
        highest = max([w["rate"] for w in timeline] + [float(v) for v in medians.values()])
        top.set_ylim(0, highest * 1.1)
        top.grid(alpha=0.3)
        if col == 0:
            fig.legend(*top.get_legend_handles_labels(), loc="upper center", ncol=4, frameon=False,
                       fontsize=10, handlelength=1.8, columnspacing=1.2)
        bottom.step(t, [w["workers"] for w in timeline], where="post", color="#1f4e9c", lw=1.6)
        if col == 0:
            bottom.set_ylabel("workers")
        bottom.set_yticks([1, 2, 3])
        bottom.set_ylim(0.5, 3.5)
        ended = run["final_workers"]
        bottom.set_xlabel(f"seconds (ended at {ended} worker{'s' if ended != 1 else ''})")
        bottom.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="a bench.balancer JSON file")
    ap.add_argument("--run", action="append", metavar="CONSUMER:ROUND",
                    help=f"an auto run to draw (repeatable; default {' '.join(DEFAULT_RUNS)})")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the PNG to write")
    a = ap.parse_args(argv)
    doc = json.loads(a.results.read_text())
    print(plot(doc, a.run or list(DEFAULT_RUNS), a.out))


if __name__ == "__main__":
    main()
