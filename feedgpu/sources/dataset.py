"""Any map-style ``torch.utils.data.Dataset`` as a feedgpu source."""
from __future__ import annotations

import numpy as np

from ..errors import SourceError
from .base import Record, Source


class DatasetSource(Source):
    """Wraps a map-style dataset whose items are ``sample`` or ``(sample, label)``.

    ``sample`` may be encoded bytes, a PIL image, an HWC uint8 numpy array or tensor; the
    decode stage accepts all of them. Labels are read lazily per item (the index holds none), so
    :attr:`labels` is -1 until read. Raises :class:`SourceError` for iterable-style datasets.
    """

    format = "dataset"

    def __init__(self, dataset, classes: list[str] | None = None):
        super().__init__()
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise SourceError("dataset source: needs a map-style dataset (__getitem__ and __len__); "
                              "IterableDataset has no random access")
        self.dataset = dataset
        self.labels = np.full(len(dataset), -1, dtype=np.int64)
        self.classes = list(classes or getattr(dataset, "classes", []) or [])

    def key(self, index: int) -> str:
        return f"{type(self.dataset).__name__}[{index}]"

    def read(self, index: int) -> Record:
        item = self.dataset[index]
        if isinstance(item, (tuple, list)) and len(item) == 2:
            sample, label = item
            return Record(sample, int(label), self.key(index))
        return Record(item, -1, self.key(index))

    def _digest(self, h) -> None:
        h.update(f"{type(self.dataset).__module__}.{type(self.dataset).__qualname__}:{len(self.dataset)}".encode())
