"""bench/cpu_loader.py's figures and report, on the runs of the recorded results file: the ratios
are taken within each round (by samples/s and by CPU seconds per sample), every part and goal is
reported, and a rerun of some parts keeps the others and the hand-written conclusions."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench.cpu_loader import FORMAT, GOALS, figures, previous_parts
from bench.cpu_loader_report import _title, markdown
from bench.harness import CONCLUSIONS, write_results

RECORDED = Path(__file__).resolve().parents[2] / "bench" / "results" / "cpu_loader.json"


@pytest.fixture(scope="module")
def doc():
    d = json.loads(RECORDED.read_text())
    assert d["format"] == FORMAT
    return d


def test_ratios_are_taken_within_each_round(doc):
    part = next(iter(doc["parts"].values()))
    rounds = part["settings"]["rounds"]
    got = figures(part["runs"], rounds)
    by = {(r["round"], r["loader"]): r for r in part["runs"]}
    sps, cpu = [], []
    for k in range(1, rounds + 1):
        x, y = by[(k, "feedgpu")], by[(k, "torch_pillow")]
        sps.append(x["samples_per_s"] / y["samples_per_s"])
        cpu.append((y["cpu_percent"] / y["samples_per_s"]) / (x["cpu_percent"] / x["samples_per_s"]))
    r = got["ratios"]["feedgpu_over_torch_pillow"]
    assert r["median"] == pytest.approx(statistics.median(sps), abs=1e-3)
    assert (r["min"], r["max"]) == pytest.approx((min(sps), max(sps)), abs=1e-3)
    assert r["cpu"]["median"] == pytest.approx(statistics.median(cpu), abs=1e-3)
    # references are compared among themselves one way only; feedgpu's loaders with every reference
    assert "torch_pillow_simd_over_torch_pillow" in got["ratios"]
    assert "torch_pillow_over_torch_pillow_simd" not in got["ratios"]
    feed = [n for n in got["summary"] if n.startswith("feedgpu")]
    refs = ("torch_pillow", "torch_pillow_simd", "spdl", "dali_hand")
    assert {f"{x}_over_{y}" for x in feed for y in refs} <= set(got["ratios"])
    for name, s in got["summary"].items():   # CPU seconds per 1,000 samples for every loader
        assert s["cpu_s_per_1000"] > 0, name


def test_report_names_every_part_goal_and_loader(doc):
    md = markdown(doc)
    for key in doc["parts"]:
        assert f"({'a' if key.startswith('imagenet') else 'b'})" in md
    goal_rows = [line for line in md.splitlines() if line.startswith("| (") and "≥" in line]
    assert len(goal_rows) == len([g for g in GOALS if g[0] in doc["parts"]])
    for g, row in zip([g for g in GOALS if g[0] in doc["parts"]], goal_rows):
        part = doc["parts"][g[0]]   # one verdict per feedgpu loader measured beside the reference
        n = sum(f"{x}_over_{g[1]}" in part["ratios"] for x in part["summary"] if x.startswith("feedgpu"))
        assert row.count("✓") + row.count("✗") == n, row
    assert not doc.get("note") or doc["note"] in md


def test_a_rerun_keeps_the_other_parts_and_the_conclusions(doc, tmp_path, capsys):
    write_results(tmp_path, "cpu_loader", doc, markdown)
    md = tmp_path / "cpu_loader.md"
    md.write_text(md.read_text() + f"\n{CONCLUSIONS}\n\nHand-written.\n")
    parts = previous_parts(tmp_path)   # what main() starts from: every part measured so far
    assert list(parts) == list(doc["parts"])
    last = list(parts)[-1]
    parts[last] = {**parts[last], "seconds": 1.0}   # a rerun of one part
    write_results(tmp_path, "cpu_loader", {**doc, "parts": parts}, markdown)
    text = md.read_text()
    assert "Hand-written." in text and text.count(CONCLUSIONS) == 1
    assert all(f"## {_title(k)}\n" in text for k in parts)
    assert "(1 s for this part)" in text
    (tmp_path / "cpu_loader.json").write_text(json.dumps({"format": "older", "parts": parts}))
    assert previous_parts(tmp_path) == {}   # another format's parts are not mixed in
