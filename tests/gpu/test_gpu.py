"""Device delivery: batches on CUDA equal the CPU path's. Skipped where torch sees no GPU."""
from __future__ import annotations

import pytest
import torch

from conftest import clone_all
from feedgpu import DataLoader, Pipeline
from feedgpu.stages import Decode, HorizontalFlip, Normalize, RandomResizedCrop

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
              pytest.mark.timeout(180)]


def _pipeline(src, device, normalize=True, **norm_kw):
    stages = [Decode(), RandomResizedCrop(96), HorizontalFlip()] + ([Normalize(**norm_kw)] if normalize else [])
    return Pipeline(src, stages, batch_size=16, num_workers=2, seed=0, device=device)


@pytest.mark.parametrize("norm", [{}, {"dtype": "float16"}, {"layout": "NHWC"}])
def test_cuda_batches_equal_the_cpu_path(sources, norm):
    src = sources["folder"]
    cpu = clone_all(DataLoader(_pipeline(src, "cpu", **norm)))
    gpu = [(b.images, b.labels) for b in DataLoader(_pipeline(src, "cuda", **norm))]
    assert len(gpu) == len(cpu)
    for (gi, gl), c in zip(gpu, cpu):
        assert gi.is_cuda and gl.is_cuda
        assert gi.dtype == c.images.dtype and gi.shape == c.images.shape
        tol = 1e-3 if gi.dtype == torch.float16 else 1e-5
        torch.testing.assert_close(gi.cpu().float(), c.images.float(), atol=tol, rtol=tol)
        assert torch.equal(gl.cpu(), c.labels)


def test_cuda_uint8_batches_are_bitwise_equal(sources):
    src = sources["folder"]
    cpu = clone_all(DataLoader(_pipeline(src, "cpu", normalize=False)))
    gpu = [b.images for b in DataLoader(_pipeline(src, "cuda", normalize=False))]
    assert len(gpu) == len(cpu)
    for g, c in zip(gpu, cpu):
        assert g.is_cuda and g.dtype == torch.uint8
        assert torch.equal(g.cpu(), c.images)


def test_auto_device_picks_cuda(sources):
    batch = next(iter(DataLoader(_pipeline(sources["folder"], "auto"))))
    assert batch.images.is_cuda


def test_state_counts_batches_the_training_loop_received_on_cuda(sources):
    """With device prefetch, batches copied ahead are not counted as seen: resume is exact."""
    src = sources["folder"]
    ref = [b.images.cpu() for b in DataLoader(_pipeline(src, "cuda"))]
    first = DataLoader(_pipeline(src, "cuda"))
    it = iter(first)
    head = [next(it).images.cpu() for _ in range(2)]
    state = first.state_dict()
    assert state["batches_seen"] == 2
    first.shutdown()
    again = DataLoader(_pipeline(src, "cuda"))
    again.load_state_dict(state)
    tail = [b.images.cpu() for b in again]
    assert len(head) + len(tail) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, ref))
