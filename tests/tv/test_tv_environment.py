"""The torchvision tier's environment: torchvision imports next to Pillow-SIMD (never stock
Pillow, which torchvision's requirements would install over it). Where torchvision does not
import, this is the tier's one test, and it skips saying why (conftest.py)."""
from __future__ import annotations

import pytest


def test_torchvision_with_pillow_simd():
    try:
        import torchvision
    except Exception as e:  # noqa: BLE001 - ImportError, or the RuntimeError of ops built for another torch
        pytest.skip(f"torchvision does not import here ({type(e).__name__}: {e}); run tests/tv in .venv-tv")
    import PIL

    assert ".post" in PIL.__version__, f"stock Pillow {PIL.__version__} replaced Pillow-SIMD; rerun scripts/setup_tv.sh"
    assert torchvision.get_image_backend() == "PIL"
