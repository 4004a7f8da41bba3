"""An IterableDataset's loader used as a temporary, as scripts do: ``for b in DataLoader(ds)``.

The loader object is dropped as soon as ``iter()`` returned; its iteration must go on to the end
(it gave nothing before: the loader's ``__del__`` stopped the pass), and no worker is left
behind once the pass is over.
"""
from __future__ import annotations

import pytest
import torch.utils.data as tud

from feedgpu import DataLoader

from conftest import child_pids, wait_gone

pytestmark = pytest.mark.timeout(120)


class Stream(tud.IterableDataset):
    """0..n-1, sharded over workers with get_worker_info() as torch's docs show."""

    def __init__(self, n: int = 10):
        self.n = n

    def __iter__(self):
        w = tud.get_worker_info()
        return iter(range(self.n) if w is None else range(w.id, self.n, w.num_workers))


class Breaks(tud.IterableDataset):
    def __iter__(self):
        yield 1
        yield 2
        raise ValueError("the stream broke")


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [3, None])
def test_a_temporary_loader_iterates_as_torchs(num_workers, batch_size):
    before = child_pids()
    got = {}
    for make in (tud.DataLoader, DataLoader):
        got[make] = [b.tolist() if hasattr(b, "tolist") else b
                     for b in make(Stream(), batch_size=batch_size, num_workers=num_workers)]
    assert got[DataLoader] == got[tud.DataLoader]
    assert sorted(v for b in got[DataLoader] for v in (b if isinstance(b, list) else [b])) == list(range(10))
    assert not wait_gone(child_pids() - before, timeout=10.0)


def test_a_temporary_loaders_stream_error_is_raised_as_torchs():
    got = {}
    for make in (tud.DataLoader, DataLoader):
        it = iter(make(Breaks(), batch_size=1, num_workers=1))
        out = []
        for _ in range(4):
            try:
                out.append(next(it).tolist())
            except StopIteration:
                out.append("end")
                break
            except ValueError:
                out.append("ValueError")
        got[make] = out
    assert got[DataLoader] == got[tud.DataLoader] == [[1], [2], "ValueError", "end"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_second_iterator_stops_the_first_loudly(num_workers):
    """torch runs two iterators of one loader side by side; feedgpu runs one at a time (as for a
    map-style dataset): the older iterator's next() raises, never a silent end of its pass."""
    from feedgpu import IteratorSuperseded

    theirs = tud.DataLoader(Stream(), batch_size=3, num_workers=num_workers)
    a, b = iter(theirs), iter(theirs)
    assert next(a).tolist() == next(b).tolist()
    ours = DataLoader(Stream(), batch_size=3, num_workers=num_workers)
    a = iter(ours)
    first = next(a).tolist()
    b = iter(ours)
    with pytest.raises(IteratorSuperseded, match="stopped by a newer iter"):
        next(a)
    assert next(b).tolist() == first
    done = iter(ours)
    rest = list(done)
    iter(ours)
    assert rest and list(done) == []   # a finished iterator just ends
