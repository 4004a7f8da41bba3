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
