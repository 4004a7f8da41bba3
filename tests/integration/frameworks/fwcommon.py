"""Shared by the framework scripts: datasets whose samples carry their index, loaders of both
kinds built from the same arguments, and the per-rank record files the pytest driver reads.

``kind`` is ``"torch"`` (``torch.utils.data.DataLoader``, the reference the harness is proven
against) or ``"feedgpu"`` (``feedgpu.DataLoader``, the same arguments). ``data`` is
``"dataset"`` (:class:`IndexDataset`) or ``"pipeline"``: for feedgpu a :class:`feedgpu.Pipeline`
over an image folder with one class per image (so a label is the sample's index), for torch
:class:`FolderImages`, the same folder read by a plain torch Dataset.
"""
from __future__ import annotations

import faulthandler
import json
import os
import traceback
from pathlib import Path

import torch
import torch.utils.data as tud

#: seconds after which a rank writes every thread's stack to its log (set by the test driver, so a
#: hung job says where each rank waited before it is killed)
DUMP_AFTER_ENV = "FEEDGPU_FW_DUMP_AFTER_S"
if os.environ.get(DUMP_AFTER_ENV):
    faulthandler.dump_traceback_later(float(os.environ[DUMP_AFTER_ENV]), exit=False)


class IndexDataset(tud.Dataset):
    """Sample ``i``: ``(float32 [4] filled with i, i)``; with ``draws=True`` a third item, an
    int64 drawn from NumPy's global RNG in the process that loads the sample (workers whose RNG
    streams were not seeded apart draw the same numbers)."""

    def __init__(self, n: int, draws: bool = False):
        self.n, self.draws = n, draws

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if self.draws:
            import numpy as np

            return torch.full((4,), float(i)), int(i), int(np.random.randint(0, 2**62))
        return torch.full((4,), float(i)), int(i)


class FolderImages(tud.Dataset):
    """torch's counterpart of the Pipeline: the class folders in sorted order, one image each;
    sample ``i``: ``(uint8 [3, 16, 16], i)`` (PIL decode and resize)."""

    def __init__(self, root: str):
        self.files = [sorted(d.iterdir())[0] for d in sorted(Path(root).iterdir()) if d.is_dir()]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i):
        import numpy as np
        from PIL import Image

        with Image.open(self.files[i]) as im:
            a = np.asarray(im.convert("RGB").resize((16, 16)))
        return torch.from_numpy(a.copy()).permute(2, 0, 1), int(i)


class ResumableTorchLoader(tud.DataLoader):
    """torch's DataLoader with the ``state_dict``/``load_state_dict`` pair that Lightning asks for
    to resume mid-epoch (plain torch's loader has none). The state is the number of batches the
    training loop took in the current epoch; after ``load_state_dict`` the next iteration replays
    that epoch's order and skips that many batches. Public torch API only."""

    _taken = 0
    _skip = 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        it = super().__iter__()
        for _ in range(skip):
            next(it)
        self._taken = skip
        for batch in it:
            self._taken += 1
            yield batch

    def state_dict(self) -> dict:
        return {"batches_taken": self._taken}

    def load_state_dict(self, state: dict) -> None:
        self._skip = int(state["batches_taken"])


def make_loader(kind: str, data: str, *, n: int, folder: str, batch_size: int, num_workers: int = 0,
                resumable: bool = False, draws: bool = False):
    """A shuffled loader of ``n`` index samples (``data="dataset"``) or of the image folder.
    ``resumable`` applies to torch only (:class:`ResumableTorchLoader`; feedgpu's loader always
    has a state)."""
    if kind == "torch":
        ds = IndexDataset(n, draws) if data == "dataset" else FolderImages(folder)
        cls = ResumableTorchLoader if resumable else tud.DataLoader
        return cls(ds, batch_size=batch_size, shuffle=True, num_workers=num_workers)
    if kind != "feedgpu":
        raise ValueError(kind)
    import feedgpu
    from feedgpu.stages import Decode, ResizeCenterCrop

    if data == "dataset":
        return feedgpu.DataLoader(IndexDataset(n, draws), batch_size=batch_size, shuffle=True, num_workers=num_workers)
    pipe = feedgpu.Pipeline({"format": "folder", "path": folder}, [Decode(), ResizeCenterCrop(16, 16)],
                            batch_size=batch_size, shuffle=True, num_workers=num_workers, device="cpu",
                            name="frameworks")
    return feedgpu.DataLoader(pipe)


def draws(batch) -> list[int] | None:
    """The per-sample draws of :class:`IndexDataset` (``draws=True``), else None."""
    return [int(v) for v in batch[2]] if len(batch) > 2 else None


def indices(batch) -> list[int]:
    """The sample indices of a batch ``(x, index)`` (a list from torch's collate, a feedgpu
    ``Batch`` or a tuple)."""
    return [int(v) for v in batch[1]]


def describe(obj) -> dict:
    """What a framework handed back for a loader: its real type (``type()``, which accelerate's
    ``__class__`` property cannot hide), what ``__class__`` claims, and the wrapped loader
    (accelerate's ``base_dataloader``, or the feedgpu loader of feedgpu's ``AcceleratedLoader``)."""
    inner = getattr(obj, "base_dataloader", None)
    if inner is None and type(obj).__name__ == "AcceleratedLoader":
        inner = obj.loader
    return {"type": f"{type(obj).__module__}.{type(obj).__qualname__}",
            "claims": f"{obj.__class__.__module__}.{obj.__class__.__qualname__}",
            "inner": None if inner is None else f"{type(inner).__module__}.{type(inner).__qualname__}",
            "dataset": type(getattr(obj, "dataset", None)).__name__}


class Records:
    """One JSON file per rank: ``{run name: {"batches": [...], "error": traceback, ...}}``,
    rewritten after every run so that what was recorded survives a later crash."""

    def __init__(self, out_dir: str):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.runs: dict = {}
        self.rank: int | None = None

    def new(self, name: str) -> dict:
        rec = {"batches": []}
        self.runs[name] = rec
        return rec

    def fail(self, rec: dict) -> None:
        rec["error"] = traceback.format_exc()

    def save(self, rank: int) -> None:
        self.rank = rank
        tmp = self.dir / f".rank{rank}.json.tmp"
        tmp.write_text(json.dumps({"rank": rank, "pid": os.getpid(), "runs": self.runs}))
        tmp.replace(self.dir / f"rank{rank}.json")


def build_folder(photos: str | Path, root: str | Path, n: int, size: int = 32) -> Path:
    """``n`` small JPEGs made from the shared photos, each in its own class folder
    ``c00 .. c{n-1}`` (so a folder source labels image ``i`` with ``i``)."""
    from PIL import Image

    files = sorted(Path(photos).glob("*.jpg"))
    if len(files) < n:
        raise ValueError(f"{photos} has {len(files)} photos, {n} needed")
    root = Path(root)
    for i, f in enumerate(files[:n]):
        d = root / f"c{i:02d}"
        d.mkdir(parents=True, exist_ok=True)
        with Image.open(f) as im:
            im.convert("RGB").resize((size, size)).save(d / "img.jpg", quality=90)
    return root
