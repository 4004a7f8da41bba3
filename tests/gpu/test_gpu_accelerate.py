"""``feedgpu.integrations.accelerate`` on a CUDA device: batches reach ``accelerator.device``, and
a pipeline delivering on CUDA (batches copied ahead on a side stream) resumes exactly through
``save_state``/``load_state``. Skipped where torch sees no GPU or accelerate is missing."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.utils.data as tud

from feedgpu import DataLoader, Pipeline
from feedgpu.stages import Decode, Normalize, ResizeCenterCrop

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate not installed"),
              pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate's states are process-wide singletons (a CPU-only Accelerator elsewhere in the
    session would refuse this module's CUDA one): reset around each test, as accelerate's own
    ``AccelerateTestCase`` does."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class IndexDataset(tud.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i):
        return torch.full((3,), float(i)), int(i)


def test_a_torch_datasets_batches_reach_the_accelerators_device():
    from accelerate import Accelerator

    from feedgpu.integrations.accelerate import prepare_data_loader

    acc = Accelerator()
    assert acc.device.type == "cuda"
    loader = prepare_data_loader(acc, DataLoader(IndexDataset(), batch_size=4, num_workers=2))
    batches = list(loader)
    assert [len(y) for _, y in batches] == [4, 4, 2]
    for x, y in batches:
        assert x.device == acc.device and y.device == acc.device


def test_cuda_pipeline_resumes_exactly_through_save_state(sources, tmp_path):
    from accelerate import Accelerator

    from feedgpu.integrations.accelerate import prepare_data_loader

    def loader(acc):
        pipe = Pipeline(sources["folder"], [Decode(), ResizeCenterCrop(32, 32), Normalize()], batch_size=8,
                        num_workers=2, seed=0, device="cuda")
        return prepare_data_loader(acc, DataLoader(pipe))

    acc = Accelerator()
    whole = [b.labels.cpu().tolist() for b in loader(acc)]
    acc = Accelerator()
    first = loader(acc)
    head = []
    for b in first:
        assert b.images.device == acc.device
        head.append(b.labels.cpu().tolist())
        if len(head) == 2:
            acc.save_state(tmp_path / "state")
            break
    acc = Accelerator()
    again = loader(acc)
    acc.load_state(tmp_path / "state")
    assert head + [b.labels.cpu().tolist() for b in again] == whole
