"""``feedgpu.torchvision`` (and ``feedgpu.integrations``) are reachable as attributes after a
plain ``import feedgpu``, as the docs use them, and ``import feedgpu`` still imports neither them
nor torchvision. Run in fresh interpreters: the test session has imported everything already."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_import_feedgpu_imports_no_subpackage_nor_torchvision():
    out = _python("import sys, feedgpu\n"
                  "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchvision'"
                  " or m in ('feedgpu.torchvision', 'feedgpu.integrations')))\n"
                  "print('torchvision' in dir(feedgpu), 'integrations' in dir(feedgpu))\n")
    assert out.split("\n")[:2] == ["[]", "True True"]


def test_pipeline_yaml_as_documented_in_a_fresh_script(folder_ds):
    out = _python("import warnings\n"
                  "import torchvision.transforms as T\n"
                  "from torchvision.datasets import ImageFolder\n"
                  "import feedgpu\n"
                  f"ds = ImageFolder({str(folder_ds)!r}, transform=T.Compose([T.RandomResizedCrop(64), "
                  "T.RandomHorizontalFlip(), T.ToTensor()]))\n"
                  "with warnings.catch_warnings():\n"
                  "    warnings.simplefilter('ignore')\n"
                  "    print(feedgpu.torchvision.pipeline_yaml(ds))\n"
                  "print(feedgpu.integrations.__name__)\n")
    assert "random_resized_crop" in out and "feedgpu.integrations" in out
