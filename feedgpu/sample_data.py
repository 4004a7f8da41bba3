"""Build ImageNet-like datasets from real photographs (one class per photo).

Recipe (the one ``shared/docs/anchors.md`` uses): a random crop of 25-100 % of the photo's area
with an aspect ratio in [3/4, 4/3], resized (Lanczos) so its longest side is 400-640 px,
saved as JPEG with quality 85-96. Deterministic for a seed. The package ships 37 photographs
(``feedgpu/assets/photos``, licenses in its SOURCES.md); ``feedgpu bench`` builds its default
sample from them once and keeps it in the user's cache directory.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
from PIL import Image

from .host import default_cache_dir

RECIPE_VERSION = 1
DEFAULT_IMAGES = 2000


def packaged_photos() -> Path:
    """Folder of the photographs shipped with feedgpu."""
    return Path(str(resources.files("feedgpu") / "assets" / "photos"))


def _photos(photos_dir: Path) -> list[Path]:
    photos = sorted(p for p in Path(photos_dir).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    if not photos:
        raise FileNotFoundError(f"no photographs in {photos_dir}")
    return photos


def build_imagenet_like(out_dir: str | os.PathLike, n_images: int = DEFAULT_IMAGES,
                        photos_dir: str | os.PathLike | None = None, seed: int = 0,
                        progress: bool = False) -> Path:
    """Write ``n_images`` JPEGs as ``out_dir/<class>/<n>.jpg`` (ImageFolder layout).

    Reuses ``out_dir`` when it already holds a complete build with the same settings (a marker
    file records them); builds in a temporary folder and renames it, so a partial build is never
    taken for a complete one. Returns ``out_dir``.
    """
    out = Path(out_dir)
    photos_dir = Path(photos_dir) if photos_dir is not None else packaged_photos()
    photos = _photos(photos_dir)
    settings = {"recipe": RECIPE_VERSION, "n_images": n_images, "seed": seed,
                "photos": [p.name for p in photos]}
    marker = out / ".feedgpu-sample.json"
    if marker.exists() and json.loads(marker.read_text()) == settings:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=out.parent))
    rng = np.random.default_rng(seed)
    it = range(n_images)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="building sample dataset", unit="img")
    opened: dict[int, Image.Image] = {}
    for i in it:
        c = i % len(photos)
        if c not in opened:
            opened[c] = Image.open(photos[c]).convert("RGB")
        img = opened[c]
        W, H = img.size
        area = W * H * rng.uniform(0.25, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = min(W, max(16, int(round(math.sqrt(area * ratio)))))
        h = min(H, max(16, int(round(math.sqrt(area / ratio)))))
        x, y = int(rng.integers(0, W - w + 1)), int(rng.integers(0, H - h + 1))
        longest = int(rng.integers(400, 641))
        s = longest / max(w, h)
        size = (max(1, round(w * s)), max(1, round(h * s)))
        crop = img.resize(size, Image.Resampling.LANCZOS, box=(x, y, x + w, y + h))
        d = tmp / f"{c:03d}_{photos[c].stem}"
        d.mkdir(exist_ok=True)
        crop.save(d / f"{i:06d}.jpg", quality=int(rng.integers(85, 97)))
    (tmp / marker.name).write_text(json.dumps(settings))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def default_sample(n_images: int = DEFAULT_IMAGES, progress: bool = True) -> Path:
    """The bench's sample dataset, built once under the user's cache directory."""
    return build_imagenet_like(default_cache_dir() / f"sample-imagenet-v{RECIPE_VERSION}-{n_images}",
                               n_images=n_images, progress=progress)
