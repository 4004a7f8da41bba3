"""``feedgpu scan``: every shared hard case found, named and counted, in every source format."""
from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from conftest import CASES, open_format
from test_decode_cases import EITHER, SKIP, expected_key
from feedgpu import DataLoader, Pipeline, SkippedSampleWarning
from feedgpu.cli.main import main as cli
from feedgpu.scan import QUARANTINE_FORMAT, guess_format, scan_source
from feedgpu.stages import Decode

pytestmark = pytest.mark.timeout(120)
FORMATS = ("folder", "tar", "parquet")


def invoke(*args):
    return CliRunner().invoke(cli, ["scan", *[str(a) for a in args]])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("workers", [0, 2])
def test_scan_finds_every_bad_case_with_its_reason_and_name(cases_datasets, fmt, workers):
    root = cases_datasets[fmt]
    src = open_format(fmt, root)
    report = scan_source(src, workers=workers, chunk=8, progress=False)
    got = {b.key: b for b in report.bad}
    for name, reason in SKIP.items():
        key = expected_key(fmt, root, name)
        assert key in got, f"{name} not reported: {sorted(got)}"
        assert got[key].reason == reason
        # found while indexing (folder, tar) or when read (parquet); never both
        assert got[key].index == (-1 if fmt != "parquet" and name == "empty.jpg" else got[key].index)
        if got[key].index >= 0:
            assert src.key(got[key].index) == key
    extra = set(got) - {expected_key(fmt, root, n) for n in SKIP | dict.fromkeys(EITHER)}
    assert not extra, f"good samples reported bad: {extra}"
    assert report.samples == len(src)
    assert [b.index for b in report.bad] == sorted(b.index for b in report.bad)
    d = report.as_dict()
    assert d["bad_total"] == len(report.bad) and sum(d["by_reason"].values()) == len(report.bad)
    assert d["by_reason"]["truncated"] == 2 and d["by_reason"]["empty"] == 1


def test_pixel_limit_is_the_scans_limit(cases_datasets):
    src = open_format("folder", cases_datasets["folder"])
    report = scan_source(src, Decode(max_pixels=50_000), workers=0, progress=False)
    too_big = {Path(b.key).name for b in report.bad if b.reason == "too many pixels"}
    assert {"bomb_20000x20000.png", "ok_rgb.jpg"} <= too_big  # 320 x 240 = 76,800 pixels
    assert "tiny_1x1.jpg" not in too_big


def test_guess_format(cases_datasets):
    assert guess_format(cases_datasets["folder"]) == "folder"
    assert guess_format(cases_datasets["tar"]) == "tar"
    assert guess_format(cases_datasets["parquet"]) == "parquet"
    assert guess_format(cases_datasets["tar"] / "cases-000000.tar") == "tar"


@pytest.mark.parametrize("fmt", FORMATS)
def test_cli_reports_and_exits_1_when_bad_samples_exist(cases_datasets, fmt, tmp_path):
    root = cases_datasets[fmt]
    q = tmp_path / "q.json"
    r = invoke(root, "--workers", 2, "--quarantine", q, "--no-progress")
    assert r.exit_code == 1, r.output
    for name, reason in SKIP.items():
        assert expected_key(fmt, root, name) in r.output
        assert f"  {reason}: " in r.output
    doc = json.loads(q.read_text())
    assert doc["format"] == QUARANTINE_FORMAT
    assert {s["key"] for s in doc["samples"]} >= {expected_key(fmt, root, n) for n in SKIP}
    assert oct(q.stat().st_mode & 0o777) == "0o644"


def test_cli_json_to_stdout(cases_datasets):
    r = invoke(cases_datasets["parquet"], "--json", "-", "--workers", 0)
    assert r.exit_code == 1
    d = json.loads(r.output)
    assert d["format"] == "parquet" and d["by_reason"]["empty"] == 1
    assert all(set(b) == {"index", "key", "reason", "detail"} for b in d["bad"])


def test_cli_exit_0_on_good_data(tmp_path):
    (tmp_path / "a").mkdir()
    for name in ("ok_rgb.jpg", "gray.jpg", "png_named.jpg"):
        (tmp_path / "a" / name).write_bytes((CASES / name).read_bytes())
    r = invoke(tmp_path, "--json", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    assert "3 samples" in r.output and "0 bad" in r.output
    assert json.loads((tmp_path / "r.json").read_text())["bad"] == []
    r = invoke(tmp_path, "--max-pixels", 50_000, "--workers", 0)  # the photos are 320 x 240
    assert r.exit_code == 1 and "too many pixels: 3" in r.output


def test_cli_errors_exit_2(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    assert invoke(tmp_path / "empty_dir").exit_code == 2  # no class folders: SourceError
    assert invoke(tmp_path / "empty_dir", "--set", "a=1").exit_code == 2
    assert invoke(tmp_path / "missing").exit_code == 2


@pytest.mark.filterwarnings("ignore:feedgpu. skipped .* while indexing")
def test_scan_to_cache_quarantines_so_the_loader_never_reads_them(cases_datasets, tmp_path):
    root = cases_datasets["folder"]
    cache_dir = tmp_path / "cache"
    pipe_file = tmp_path / "p.yaml"
    pipe_file.write_text(yaml.safe_dump({
        "source": {"format": "folder", "path": str(root)},
        "stages": [{"op": "decode"}, {"op": "resize_center_crop", "resize": 40, "crop": 32}],
        "loader": {"batch_size": 8, "num_workers": 0, "shuffle": False, "max_skipped": None},
        "output": {"device": "cpu", "dtype": "uint8", "layout": "NHWC"},
        "cache": {"enabled": True, "dir": str(cache_dir)}}))
    r = invoke(pipe_file, "--to-cache", "--workers", 2)
    assert r.exit_code == 1, r.output
    assert "quarantined 4 samples in cache entry" in r.output  # empty.jpg never made the index

    loader = DataLoader(Pipeline.from_yaml(pipe_file))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = sum(len(b.labels) for b in loader)
    assert n == len(loader.pipeline.source)
    msgs = [str(w.message) for w in caught if issubclass(w.category, SkippedSampleWarning)]
    quarantined = [m for m in msgs if "quarantined in the cache" in m]
    names = {Path(m.split(": ")[0].split()[-1]).name for m in quarantined}
    assert {"truncated_half.jpg", "truncated.png", "html_named.jpg", "bomb_20000x20000.png"} <= names
    assert loader.stats()["cache"]["quarantined"] >= 4


class KillsOnce:
    """Wraps a source: the first read of sample 5 (marked by a file, across processes) kills the
    worker reading it, as the kernel's out-of-memory killer would."""

    def __init__(self, src, marker: str):
        self.src, self.marker = src, marker

    def __getattr__(self, name):
        return getattr(self.src, name)

    def __len__(self):
        return len(self.src)

    def read(self, index):
        if index == 5:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.src.read(index)


def test_a_scan_worker_killed_mid_chunk_is_replaced_and_its_chunk_checked_again(cases_datasets, tmp_path):
    src = open_format("folder", cases_datasets["folder"])
    whole = scan_source(src, workers=0, chunk=4, progress=False)
    report = scan_source(KillsOnce(src, str(tmp_path / "killed")), workers=2, chunk=4, progress=False)
    assert (tmp_path / "killed").exists(), "no worker was killed: the test tests nothing"
    assert report.samples == whole.samples and report.bad == whole.bad
