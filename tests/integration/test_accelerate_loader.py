"""``feedgpu.integrations.accelerate`` in one process (accelerate 1.15, ``Accelerator(cpu=True)``):
what ``prepare()`` hands back, feedgpu's pool, the sync flags of gradient accumulation side by
side with a torch loader accelerate prepared, ``save_state``/``load_state`` mid-epoch, and the
refusals. Two processes under torchrun: ``test_frameworks.py``.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
import torch.utils.data as tud

import feedgpu
from conftest import REPO

if importlib.util.find_spec("accelerate") is None:
    raise ImportError("tests/integration/test_accelerate_loader.py needs accelerate (pip install -e '.[dev]')")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402

from feedgpu.integrations.accelerate import AcceleratedLoader, prepare, prepare_data_loader  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate's states are process-wide singletons: reset after each test, as accelerate's
    own ``AccelerateTestCase`` does, so no test (here or in another module of the session, on
    another device) inherits this one's."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class IndexDataset(tud.Dataset):
    """Sample ``i``: ``(float32 [2] filled with i, i)``."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.full((2,), float(i)), int(i)


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def accelerator(steps: int = 2, **config) -> Accelerator:
    dl = DataLoaderConfiguration(**config) if config else None
    return Accelerator(gradient_accumulation_steps=steps, cpu=True, dataloader_config=dl)


def train(acc: Accelerator, loader, epochs: int = 2, stop_after: int | None = None, save_to=None,
          load_from=None) -> list[tuple[int, list[int], bool]]:
    """Per batch ``(epoch, sample indices, accelerator.sync_gradients)``; ``save_to``: save_state
    after ``stop_after`` batches of epoch 0 (and go on); without ``save_to``, ``stop_after``
    breaks out of the loop there."""
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    model, opt, loader = acc.prepare(model, opt, loader)
    first = 0
    if load_from is not None:
        acc.load_state(load_from)
        first = loader.state_dict()["epoch"]   # the epoch to go on with (the next one after its last batch)
    got = []
    for epoch in range(first, epochs):
        loader.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            with acc.accumulate(model):
                acc.backward(model(x.mean(1, keepdim=True)).pow(2).mean())
                opt.step()
                opt.zero_grad()
                got.append((epoch, [int(v) for v in y], bool(acc.sync_gradients)))
            if stop_after is not None and epoch == 0 and i + 1 == stop_after:
                if save_to is None:
                    return got
                acc.save_state(save_to)
    return got


def feedgpu_loader(n: int = 18, workers: int = 0, **kw) -> feedgpu.DataLoader:
    return feedgpu.DataLoader(IndexDataset(n), batch_size=2, shuffle=True, num_workers=workers, seed=7, **kw)


def test_prepare_hands_back_feedgpus_loader_and_its_pool_runs():
    acc = accelerator()
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    loader = feedgpu_loader(workers=2)
    pmodel, popt, ploader = prepare(acc, model, opt, loader)
    assert isinstance(ploader, AcceleratedLoader) and ploader.loader is loader
    assert popt is not opt and pmodel is acc._models[-1]   # the others went through accelerate
    assert acc.prepare(ploader) is ploader                 # accelerate hands it back as it is
    assert len(ploader) == len(loader) == 9
    pids, seen = [], []
    for x, y in ploader:
        pids.append(len(ploader.worker_pids()))
        seen += [int(v) for v in y]
    assert sorted(seen) == list(range(18)) and pids[0] == 2   # (the pool stops once the epoch is read)
    assert ploader.stats()["batches"] == 9 and ploader.stats()["samples"] == 18


@pytest.mark.parametrize("n,steps", [(18, 2), (17, 2), (20, 3), (16, 3)])
def test_sync_flags_are_those_of_a_torch_loader_accelerate_prepared(n, steps):
    """The epoch's last batch is a sync step, whatever the count modulo the accumulation, as
    with accelerate's own loader over the same dataset (side by side, 2 epochs)."""
    torch_flags = [f for _, _, f in train(accelerator(steps), tud.DataLoader(IndexDataset(n), batch_size=2,
                                                                              shuffle=True))]
    acc = accelerator(steps)
    ours = train(acc, prepare_data_loader(acc, feedgpu_loader(n)))
    assert [f for _, _, f in ours] == torch_flags
    for epoch in range(2):
        assert sorted(i for e, b, _ in ours if e == epoch for i in b) == list(range(n))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("saved_after", [1, 3, 9])
def test_save_state_mid_epoch_then_load_state_gives_exactly_the_rest(tmp_path, workers, saved_after):
    """save_state after batch ``saved_after`` of epoch 0 (one batch already read ahead; 9: the
    epoch's last), a new Accelerator and loader, load_state: the batches and sync flags are the
    uninterrupted run's from there on."""
    acc = accelerator()
    full = train(acc, prepare_data_loader(acc, feedgpu_loader(workers=workers)), stop_after=saved_after,
                 save_to=tmp_path / "state")
    acc2 = accelerator()
    resumed = train(acc2, prepare_data_loader(acc2, feedgpu_loader(workers=workers)), load_from=tmp_path / "state")
    assert resumed == full[saved_after:]


def test_state_after_breaking_out_counts_only_the_batches_the_loop_got(tmp_path):
    """A loop that breaks out mid-epoch has not received the batch read ahead: the state saved
    after the break resumes with it."""
    acc = accelerator()
    loader = prepare_data_loader(acc, feedgpu_loader())
    head = train(acc, loader, stop_after=4)
    acc.save_state(tmp_path / "state")
    acc2 = accelerator()
    rest = train(acc2, prepare_data_loader(acc2, feedgpu_loader()), load_from=tmp_path / "state")
    whole = train(accelerator(), prepare_data_loader(accelerator(), feedgpu_loader()))
    assert [b for _, b, _ in head + rest] == [b for _, b, _ in whole]


def test_epochs_advance_without_set_epoch():
    """accelerate's own loaders advance their epoch at each iteration; so does feedgpu's."""
    acc = accelerator()
    loader = prepare_data_loader(acc, feedgpu_loader())
    epochs = [[int(i) for _, y in loader for i in y] for _ in range(3)]
    assert all(sorted(e) == list(range(18)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3 and loader.state_dict()["epoch"] == 3


def test_an_iteration_superseded_and_closed_late_leaves_the_new_one_marking_the_end():
    acc = accelerator()
    loader = prepare_data_loader(acc, feedgpu_loader())
    old = iter(loader)
    next(old)
    new = iter(loader)
    ends = [(next(new), acc.gradient_state.end_of_dataloader)[1]]
    old.close()   # the superseded iteration goes only now
    ends += [acc.gradient_state.end_of_dataloader for _ in new]
    assert ends == [False] * 8 + [True]


def test_skip_first_batches_is_refused_naming_load_state():
    acc = accelerator()
    loader = prepare_data_loader(acc, feedgpu_loader())
    with pytest.raises(AttributeError, match="load_state"):
        acc.skip_first_batches(loader, 2)
    assert loader.loader.sampler is not None and not hasattr(loader, "batch_sampler")


def test_preparing_twice_registers_once_and_batches_keep_their_type():
    acc = accelerator()
    loader = feedgpu_loader()
    a = prepare_data_loader(acc, loader)
    assert prepare_data_loader(acc, loader) is a and prepare_data_loader(acc, a) is a
    assert acc._custom_objects.count(a) == 1
    assert a.device == acc.device and prepare_data_loader(accelerator(), loader, device_placement=False).device is None
    x, y = next(iter(a))
    assert isinstance(x, torch.Tensor) and x.device == acc.device and x.shape == (2, 2)
    assert a.total_batch_size == 2 and a.total_dataset_length == 18 and a.dataset is loader.dataset


def test_what_cannot_run_as_feedgpu_runs_it_is_refused():
    with pytest.raises(TypeError, match="feedgpu.DataLoader"):
        prepare_data_loader(accelerator(), tud.DataLoader(IndexDataset(4)))
    with pytest.raises(feedgpu.ConfigError, match="IterableDataset"):
        prepare_data_loader(accelerator(), feedgpu.DataLoader(Stream(), batch_size=2))
    with pytest.raises(feedgpu.ConfigError, match="split_batches"):
        prepare_data_loader(accelerator(split_batches=True), feedgpu_loader())
    with pytest.raises(feedgpu.ConfigError, match="dispatch_batches"):
        prepare_data_loader(accelerator(dispatch_batches=True), feedgpu_loader())
    with pytest.raises(ValueError, match="device_placement"):
        prepare(accelerator(), feedgpu_loader(), device_placement=[True, False])


def test_import_feedgpu_does_not_import_accelerate():
    code = "import sys, feedgpu, feedgpu.integrations; print('accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
