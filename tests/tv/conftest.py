"""The torchvision tier: feedgpu's torchvision backend against the real torchvision package.

These tests run in ``.venv-tv`` (PyPI's torch and torchvision, built by ``scripts/setup_tv.sh``;
``.ci/run`` and ``scripts/test.sh`` run them there). Where torchvision does not import (``.venv``
holds torch's CPU build, beside which PyPI's torchvision fails to load its ops) the folder is
skipped as a whole, with the reason.
"""
from __future__ import annotations

from pathlib import Path

import pytest

try:
    import torchvision  # noqa: F401
    _WHY_NOT = None
except Exception as e:  # noqa: BLE001 - ImportError, or the RuntimeError of ops built for another torch
    _WHY_NOT = f"torchvision does not import here ({type(e).__name__}: {e}); run these tests in .venv-tv"

if _WHY_NOT is not None:   # test_environment.py alone is collected: it skips, saying why
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name != "test_environment.py"]


@pytest.fixture(scope="session")
def small_ds(folder_ds, tmp_path_factory) -> Path:
    """The sample dataset's images with the short side reduced to 160-200 px (ImageFolder
    layout, JPEG quality 90): cheap samples for statistics over thousands of them."""
    from PIL import Image

    out = tmp_path_factory.mktemp("small") / "train"
    for k, src in enumerate(sorted(Path(folder_ds).rglob("*.jpg"))):
        dst = out / src.parent.name / src.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(src) as im:
            im = im.convert("RGB")
            short = 160 + (k * 7) % 41
            scale = short / min(im.size)
            im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))),
                      Image.Resampling.BILINEAR).save(dst, quality=90)
    return out
