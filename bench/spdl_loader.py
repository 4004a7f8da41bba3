"""SPDL (Scalable and Performant Data Loading) as a benchmark loader: the same recipes as a
feedgpu pipeline, written the way SPDL's examples write them.

SPDL decodes with FFmpeg (libavcodec's JPEG decoder, libswscale for the resize) in a thread
pool, outside the GIL: one pipeline of ``spdl.pipeline.PipelineBuilder`` per epoch, the source
the epoch's sample order, then ``pipe(load, concurrency=threads)`` (read the file, demux, draw
the crop window from the stored size, decode through an FFmpeg filter graph: ``crop`` +
``scale`` (bilinear) + ``hflip`` for the train recipe, ``scale`` (short side to ``resize``) +
centre ``crop`` for val; ``format=rgb24``), ``aggregate(batch_size, drop_last)`` and a collate
stage that stacks the uint8 HWC images and normalizes them to float32 NCHW with torch ops. The
executor has ``threads`` threads (the worker count of the process-based loaders: equal cores).
EXIF orientation is not applied (FFmpeg does not read it for images).

SPDL is not a dependency of feedgpu: :func:`ensure_spdl` installs ``spdl`` from PyPI into
``bench/.spdl`` once (without dependencies: it needs numpy only), and its child process puts
that folder first on ``PYTHONPATH``. Its decoder needs FFmpeg's shared libraries (FFmpeg 4-9;
Debian 12: ``apt-get install --no-install-recommends libavcodec59 libavformat59 libavfilter8
libavdevice59 libswscale6 libswresample4``).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

from bench.harness import REPO

__all__ = ["SPDL_DIR", "SPDL_REQ", "SpdlLoader", "ensure_spdl", "spdl_env", "spdl_subject"]

SPDL_DIR = REPO / "bench" / ".spdl"
SPDL_REQ = ("spdl==0.8.*", "spdl-core==0.8.*", "spdl-io==0.8.*")
FFMPEG_HINT = ("SPDL's decoder needs FFmpeg's shared libraries (Debian 12: apt-get install --no-install-recommends "
               "libavcodec59 libavformat59 libavfilter8 libavdevice59 libswscale6 libswresample4); or leave "
               "spdl out of --loaders")


def spdl_env() -> dict:
    """The environment of a child that imports SPDL: ``bench/.spdl`` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SPDL_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def ensure_spdl() -> str:
    """Install SPDL into ``bench/.spdl`` once; check that it decodes a JPEG here (FFmpeg's libraries
    found); return its version. Exits with a message naming what is missing."""
    if not (SPDL_DIR / "spdl" / "io" / "__init__.py").exists():
        print(f"installing {', '.join(SPDL_REQ)} into {SPDL_DIR} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(SPDL_DIR),
                        *SPDL_REQ], check=True)
    probe = ("import io, importlib.metadata as m, numpy as np, spdl.io\n"
             "from PIL import Image\n"
             "b = io.BytesIO(); Image.new('RGB', (16, 16)).save(b, 'JPEG')\n"
             "spdl.io.load_image(b.getvalue())\n"
             "print(m.version('spdl-io'))")
    out = subprocess.run([sys.executable, "-c", probe], env=spdl_env(), capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        sys.exit(f"SPDL in {SPDL_DIR} does not decode here: {out.stderr.strip().splitlines()[-1:]}. {FFMPEG_HINT}")
    return out.stdout.strip()


class SpdlLoader:
    """Batches ``(images float32 NCHW, labels int64)`` of ``pipeline``'s source and recipe
    (``"train"``: random resized crop + flip; ``"val"``: resize + centre crop; both then
    normalize) through an SPDL pipeline of ``threads`` threads. Shuffled per epoch when the
    pipeline shuffles (seeded); ``drop_last`` as the pipeline says."""

    def __init__(self, pipeline, batch_size: int, threads: int, recipe: str, seed: int = 0):
        from feedgpu.stages import HorizontalFlip, Normalize, RandomResizedCrop, ResizeCenterCrop

        st = {type(s): s for s in pipeline.stages}
        self.source, self.recipe = pipeline.source, recipe
        self.rrc, self.flip = st.get(RandomResizedCrop), st.get(HorizontalFlip)
        self.rcc, self.norm = st.get(ResizeCenterCrop), st[Normalize]
        if (self.rrc if recipe == "train" else self.rcc) is None:
            raise ValueError(f"the pipeline has no stage of the {recipe} recipe")
        self.batch_size, self.threads, self.seed = batch_size, threads, seed
        self.shuffle, self.drop_last = pipeline.shuffle, pipeline.drop_last
        self.n = len(pipeline.source)
        self.epoch = 0
        self._pipe = None

    def __len__(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def _filter(self, width: int, height: int, rng: random.Random) -> str:
        from feedgpu.stages.geometry import random_resized_crop_params

        if self.recipe == "train":
            top, left, h, w = random_resized_crop_params(width, height, self.rrc.scale, self.rrc.ratio,
                                                         [rng.random() for _ in range(22)])
            oh, ow = self.rrc.size
            desc = f"crop={w}:{h}:{left}:{top},scale={ow}:{oh}:flags=bilinear"
            if self.flip is not None and rng.random() < self.flip.p:
                desc += ",hflip"
        else:
            r, (ch, cw) = self.rcc.resize, self.rcc.crop
            rw, rh = (r, int(r * height / width)) if width <= height else (int(r * width / height), r)
            desc = f"scale={rw}:{rh}:flags=bilinear,crop={cw}:{ch}"
        return desc + ",format=rgb24"

    def _load(self, item):
        import spdl.io

        index, seed = item
        rec = self.source.read(index)
        packets = spdl.io.demux_image(bytes(rec.payload))
        desc = self._filter(packets.width, packets.height, random.Random(seed))
        frames = spdl.io.decode_packets(packets, filter_desc=desc)
        return spdl.io.to_numpy(spdl.io.convert_frames(frames)), rec.label

    def _collate(self, items):
        import numpy as np
        import torch

        x = torch.from_numpy(np.stack([a for a, _ in items]))            # N, H, W, 3 uint8
        mean = torch.tensor(self.norm.mean).mul_(255).view(1, 3, 1, 1)
        std = torch.tensor(self.norm.std).mul_(255).view(1, 3, 1, 1)
        images = x.permute(0, 3, 1, 2).float().sub_(mean).div_(std).contiguous()
        return images, torch.tensor([label for _, label in items], dtype=torch.int64)

    def __iter__(self):
        from spdl.pipeline import PipelineBuilder

        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1000 + self.epoch).shuffle(order)
        draws = random.Random(self.seed * 1000 + self.epoch + 1)
        items = [(i, draws.getrandbits(63)) for i in order]
        self.epoch += 1
        self._pipe = (PipelineBuilder().add_source(items)
                      .pipe(self._load, concurrency=self.threads)
                      .aggregate(self.batch_size, drop_last=self.drop_last)
                      .pipe(self._collate)
                      .add_sink(2)
                      .build(num_threads=self.threads))
        with self._pipe.auto_stop():
            yield from self._pipe.get_iterator()
        self._pipe = None

    def close(self) -> None:
        self._pipe = None


def spdl_subject(pipeline, workers: int, batch_size: int, recipe: str):
    """:class:`SpdlLoader` as a measured subject (``feedgpu.bench.measure``): no worker processes,
    ``workers`` threads."""
    from feedgpu.bench.subjects import Subject

    loader = SpdlLoader(pipeline, batch_size, workers, recipe)
    return Subject("spdl", "SPDL (FFmpeg decode + filter graph, thread pool)", loader, lambda: [], "cpu",
                   loader.close, lambda: {"threads": workers})
