"""Run PyTorch's own DataLoader tests twice, with torch's loader and with feedgpu.DataLoader
swapped in, and list the behavioural differences: the tests that pass with torch's loader and
fail with feedgpu's.

PyTorch's tests are not in its wheel: give the path of ``test/test_dataloader.py`` from the
PyTorch source at the tag of the installed version (``torch.__version__``), e.g. a checkout of
``v2.13.0``; its imports (``torch.testing._internal``, which needs the ``expecttest`` package of
the ``dev`` extra) come from the installed torch::

    python scripts/torch_suite.py /path/to/pytorch/test/test_dataloader.py [-k EXPR] [--json out.json]

The swap: before the test module is imported, ``torch.utils.data.DataLoader`` (and the name in
``torch.utils.data.dataloader``) is replaced by ``feedgpu.DataLoader``, so every
``from torch.utils.data import DataLoader`` in the tests builds feedgpu's. Each run is one
``pytest`` process with a JUnit XML report; a test that fails with both loaders is not counted
(an environment limit, e.g. CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

_PLUGIN = '''
import torch.utils.data as tud
import torch.utils.data.dataloader as tdl

import feedgpu


def pytest_configure(config):
    tud.DataLoader = feedgpu.DataLoader
    tdl.DataLoader = feedgpu.DataLoader
'''


def outcomes(report: Path) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "skipped"}`` from a JUnit XML report."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return out


def run(test_file: Path, swapped: bool, extra: list[str], work: Path) -> dict[str, str]:
    report = work / ("feedgpu.xml" if swapped else "torch.xml")
    env = dict(os.environ)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file),
            f"--junitxml={report}", "--timeout=300", *extra]
    if swapped:
        (work / "feedgpu_swap.py").write_text(_PLUGIN)
        env["PYTHONPATH"] = os.pathsep.join([str(work), env.get("PYTHONPATH", "")])
        args[3:3] = ["-p", "feedgpu_swap"]
    subprocess.run(args, env=env, cwd=test_file.parent)
    return outcomes(report)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("test_file", type=Path, help="PyTorch's test/test_dataloader.py")
    ap.add_argument("-k", help="pytest -k expression (a subset of the tests)")
    ap.add_argument("--json", type=Path, help="write the outcomes and the differences here")
    a = ap.parse_args(argv)
    extra = ["-k", a.k] if a.k else []
    with tempfile.TemporaryDirectory() as tmp:
        theirs = run(a.test_file.resolve(), False, extra, Path(tmp))
        ours = run(a.test_file.resolve(), True, extra, Path(tmp))
    differences = sorted(t for t, o in theirs.items() if o == "passed" and ours.get(t) == "failed")
    both_fail = sorted(t for t, o in theirs.items() if o == "failed" and ours.get(t) == "failed")
    print(f"{len(theirs)} tests; with torch's loader {sum(o == 'passed' for o in theirs.values())} passed; "
          f"behavioural differences (pass with torch's, fail with feedgpu's): {len(differences)}; "
          f"failing with both (not counted): {len(both_fail)}")
    for t in differences:
        print(f"  {t}")
    if a.json:
        a.json.write_text(json.dumps({"torch": theirs, "feedgpu": ours, "differences": differences,
                                      "failing_with_both": both_fail}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
