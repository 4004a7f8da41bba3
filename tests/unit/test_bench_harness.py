"""bench/harness.py, what the recorded benchmarks share: rounds, medians, tables, and results
files whose hand-written conclusions survive a rerun."""
from __future__ import annotations

import json

from bench.harness import CONCLUSIONS, alternating, md_table, ratio, spread, write_results


def test_rounds_alternate_and_rotate():
    assert alternating(["a", "b", "c"], 2) == [(1, "a"), (1, "b"), (1, "c"), (2, "a"), (2, "b"), (2, "c")]
    assert alternating(["a", "b", "c"], 3, rotate=True) == [
        (1, "a"), (1, "b"), (1, "c"), (2, "b"), (2, "c"), (2, "a"), (3, "c"), (3, "a"), (3, "b")]


def test_spread_ratio_and_table():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}
    assert spread([1.234, 2.345], digits=1) == {"median": 1.8, "min": 1.2, "max": 2.3}
    assert ratio(6.0, 3.0) == 2.0 and ratio(None, 3.0) is None and ratio(1.0, 0.0) is None
    assert md_table(("loader", "samples/s"), [("feedgpu", 512), ("torch", None)]) == [
        "| loader | samples/s |", "| --- | ---: |", "| feedgpu | 512 |", "| torch | - |"]


def test_a_rerun_rewrites_the_figures_and_keeps_the_conclusions(tmp_path, capsys):
    def markdown(doc):
        return f"# Run\n\nrate: {doc['rate']}\n"

    write_results(tmp_path, "x", {"rate": 1, "total_seconds": 1.0}, markdown)
    md = tmp_path / "x.md"
    assert md.read_text() == "# Run\n\nrate: 1\n"
    md.write_text(md.read_text() + f"\n{CONCLUSIONS}\n\nWritten by hand: rate 1 is slow.\n")
    write_results(tmp_path, "x", {"rate": 2, "total_seconds": 1.0}, markdown)
    assert md.read_text() == f"# Run\n\nrate: 2\n\n{CONCLUSIONS}\n\nWritten by hand: rate 1 is slow.\n"
    assert json.loads((tmp_path / "x.json").read_text())["rate"] == 2
    assert "rate: 2" in capsys.readouterr().out


def _run(loader: str, samples: int, batches: int, seconds: float, waits_median: float) -> dict:
    return {"loader": loader, "label": loader, "workers": 2, "samples": samples, "batches": batches,
            "seconds": seconds, "samples_per_s": samples / seconds, "ms_per_batch": 1e3 * seconds / batches,
            "wait_ms_median": waits_median, "first_batch_s": 1.0, "cpu_percent": 150.0,
            "rss_peak_mb_per_worker": [900.0, 910.0], "uss_mb_per_worker": [40.0, 42.0],
            "pss_mb_per_worker": [300.0, 310.0], "rss_peak_mb_main": 500.0, "output": {}}


def test_the_summary_rate_and_time_per_batch_come_from_the_same_window():
    """samples/s x ms/batch is the batch size, with an even number of rounds (a median of two) and a
    short last batch; the consumer's wait in next() is reported apart, under its own name."""
    from feedgpu.bench.measure import summarize

    runs = [_run("feedgpu", 256 * 4, 4, 5.4, 1185.5), _run("feedgpu", 256 * 9 + 100, 10, 11.9, 1000.0)]
    s = summarize(runs)["feedgpu"]
    rows = (256 * 13 + 100) / 14
    assert abs(s["samples_per_s"] * s["ms_per_batch"] / 1e3 - rows) < 1e-9
    assert s["wait_ms_median"] == (1185.5 + 1000.0) / 2 and s["timed_batches"] == 7
    assert s["uss_mb_per_worker"] == 41.0 and s["pss_mb_per_worker"] == 305.0


def test_the_table_shows_what_a_user_compares():
    from feedgpu.bench.report import format_table
    from feedgpu.bench.measure import summarize

    table = format_table(summarize([_run("feedgpu", 1024, 4, 5.4, 1185.5)]))
    header, _, row = table.splitlines()
    assert "USS/worker MB" in header and "RSS" not in header and "timed batches" in header
    cells = dict(zip(["samples/s", "ms/batch"], [c for c in row.split() if c.replace(".", "").isdigit()][1:3]))
    assert cells == {"samples/s": "190", "ms/batch": "1350.0"}   # 256 / 1.35 s = 190/s
