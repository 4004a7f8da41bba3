"""feedgpu's loader under Hugging Face accelerate: its pool, pipeline, sharding and state kept.

``accelerator.prepare()`` rebuilds every ``torch.utils.data.DataLoader`` it is given (feedgpu's
is one) as torch's ``DataLoader`` around ``loader.dataset``, so the batches then come from
torch's loader, not feedgpu's. accelerate has no public way to keep a loader of another class
in ``prepare()``; an object that is not a ``DataLoader`` it hands back unchanged. So a feedgpu
loader goes through :func:`prepare_data_loader` first, and ``prepare()`` then keeps it::

    from feedgpu.integrations.accelerate import prepare_data_loader

    accelerator = Accelerator(gradient_accumulation_steps=2)
    loader = prepare_data_loader(accelerator, feedgpu.DataLoader(dataset, batch_size=32, shuffle=True))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

or in one call, ``model, optimizer, loader = prepare(accelerator, model, optimizer, loader)``.

The :class:`AcceleratedLoader` it returns iterates the feedgpu loader itself, and

* shards as feedgpu does (rank and world size of the ``torch.distributed`` group accelerate set
  up, :mod:`feedgpu.order.sharded`): every rank gets ``len(loader)`` batches, disjoint apart from
  feedgpu's documented padding;
* tells accelerate's ``GradientState`` which batch ends the epoch, through accelerate's
  ``DataLoaderStateMixin`` (it reads one batch ahead, as accelerate's own loaders do), so under
  gradient accumulation the epoch's last batch is a sync step;
* is registered with ``accelerator.register_for_checkpointing``: ``save_state`` writes the
  position (the batches the training loop received, not the one read ahead), ``load_state``
  restores it, and the next iteration gives exactly the rest of the epoch (do not also call
  ``accelerator.skip_first_batches``: it rebuilds a torch loader, and this class refuses it);
* moves batches to ``accelerator.device`` when ``device_placement`` is on, as accelerate does.

Where it differs from a loader accelerate prepared: feedgpu's sharding and padding instead of
``even_batches``' (``gather_for_metrics`` gets ``remainder == -1`` and keeps the padded samples:
see the docs), and ``split_batches``, ``dispatch_batches``, an ``IterableDataset``, XLA and
tensor/context parallelism without an explicit ``rank``/``world_size`` are refused.
"""
from __future__ import annotations

import weakref

import torch.utils.data as tud
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from accelerate.utils import DistributedType, send_to_device

from ..errors import ConfigError
from ..loader.front import DataLoader

__all__ = ["AcceleratedLoader", "prepare", "prepare_data_loader"]

# attributes accelerate reads to rebuild a loader (skip_first_batches, prepare_data_loader):
# refused, so a rebuild fails loudly instead of training on torch's loader with the wrong shard
_REBUILT_FROM = ("sampler", "batch_sampler")
_NO_REBUILD = ("accelerate rebuilds a torch DataLoader from a loader's sampler (skip_first_batches, "
               "prepare_data_loader), which would run without feedgpu and without its sharding; a loader "
               "prepared by feedgpu.integrations.accelerate resumes by itself: accelerator.load_state() "
               "restores its position, then iterate it (the sampler is at .loader.sampler)")

# (id(loader), id(accelerator)) -> its AcceleratedLoader, so that preparing twice registers once
_prepared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class AcceleratedLoader(DataLoaderStateMixin):
    """A :class:`feedgpu.DataLoader` as accelerate's training loop sees it (made by
    :func:`prepare_data_loader`; not a ``torch.utils.data.DataLoader``, so ``prepare()`` hands
    it back unchanged).

    Iterating yields the feedgpu loader's batches (moved to ``device`` when it is set), one
    epoch per iteration; ``end_of_dataloader`` is True while the epoch's last batch is out.
    ``len()`` is the feedgpu loader's (batches per rank). ``set_epoch``, ``stats()``,
    ``worker_pids()`` and the other attributes of the feedgpu loader (``loader``) are reached
    through this object; ``sampler`` and ``batch_sampler`` raise ``AttributeError`` (reading
    them is how accelerate rebuilds a loader without feedgpu).

    Args:
        loader: the feedgpu loader (map-style dataset or Pipeline).
        device: where batches go (``torch.device``), or None to leave them where the loader
            delivers them.
        non_blocking: passed to ``Tensor.to`` when moving batches.
        num_processes: data-parallel processes (for ``total_batch_size``).
    """

    def __init__(self, loader: DataLoader, device=None, non_blocking: bool = False, num_processes: int = 1):
        self.loader = loader
        self.device = device
        self.non_blocking = bool(non_blocking)
        self.num_processes = int(num_processes)
        self.gradient_state = GradientState()
        # the loader's state as of the batches the training loop received, while one more is
        # read ahead; valid until the next iteration, set_epoch or load_state_dict
        self._snapshot: dict | None = None
        self._iterations = 0   # the live iteration's number: only it leaves GradientState
        self._accelerator = None

    def __getattr__(self, name: str):
        if name in _REBUILT_FROM:
            raise AttributeError(f"{type(self).__name__}.{name}: {_NO_REBUILD}")
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all processes (``batch_size * num_processes``); None when the
        loader's batches come from a ``batch_sampler``."""
        bs = self.loader.batch_size
        return None if bs is None else bs * self.num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(self.loader.dataset)

    def begin(self) -> None:
        super().begin()
        # accelerate's remainder says how many samples of the gathered last step are real,
        # assuming its own layout (padding at the end of the gathered tensor); feedgpu's
        # padding is spread over the ranks' last batches, where a prefix of the gathered tensor
        # can drop real samples and keep repeats: -1 tells gather_for_metrics to keep them all
        self.remainder = -1

    def __iter__(self):
        self._snapshot = None
        self._iterations += 1
        mine = self._iterations
        self.begin()
        loader = self.loader
        try:
            it = iter(loader)
            try:
                current = next(it)
            except StopIteration:
                return
            while True:
                self._snapshot = loader.state_dict()   # before the batch read ahead is counted
                try:
                    following = next(it)
                except StopIteration:
                    self.end_of_dataloader = True
                    yield self._place(current)
                    break
                yield self._place(current)
                current = following
        finally:
            # an iteration a newer one superseded, closed late, must not unregister the newer one
            if self._iterations == mine:
                self.end()

    def _place(self, batch):
        if self.device is None:
            return batch
        return send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def set_epoch(self, epoch: int) -> None:
        """:meth:`feedgpu.DataLoader.set_epoch` (right after ``load_state``, the restored epoch
        keeps its position)."""
        self._snapshot = None
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict:
        """The feedgpu loader's state (:mod:`feedgpu.loader.state`) counting the batches this
        object handed to the training loop; what ``accelerator.save_state`` writes."""
        return dict(self._snapshot) if self._snapshot is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """:meth:`feedgpu.DataLoader.load_state_dict`: the next iteration gives the rest of the
        saved epoch. Raises :class:`~feedgpu.errors.StateError` for another dataset or order."""
        self._snapshot = None
        self.loader.load_state_dict(state)


def _refuse_unsupported(accelerator, loader: DataLoader) -> None:
    """ConfigError for what accelerate would do to the batches that this class cannot."""
    if isinstance(loader.dataset, tud.IterableDataset):
        raise ConfigError("feedgpu runs an IterableDataset as torch does, without sharding it over ranks: give "
                          "that loader to accelerator.prepare() (accelerate shards it), not to prepare_data_loader")
    if accelerator.split_batches:
        raise ConfigError("Accelerator(split_batches=True) splits each batch over the processes; feedgpu gives every "
                          "rank batches of batch_size: use split_batches=False and the per-process batch size")
    if accelerator.dispatch_batches:
        raise ConfigError("Accelerator(dispatch_batches=True) loads on process 0 and sends the batches; feedgpu "
                          "loads each rank's shard where it trains: use dispatch_batches=False")
    if accelerator.distributed_type == DistributedType.XLA:
        raise ConfigError("feedgpu.integrations.accelerate does not support XLA devices")
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and (pc.tp_enabled or pc.cp_enabled) and (loader.rank is None or loader.world_size is None):
        raise ConfigError("with tensor or context parallelism the ranks of one group need the same batches; "
                          "give the feedgpu DataLoader rank= and world_size= of the data-parallel group")


def prepare_data_loader(accelerator, loader, device_placement: bool | None = None) -> AcceleratedLoader:
    """Make ``loader`` (a :class:`feedgpu.DataLoader`) run under ``accelerator`` as itself.

    Returns an :class:`AcceleratedLoader`, registered once with
    ``accelerator.register_for_checkpointing`` (preparing the same loader again returns the
    same object). Register and prepare in the same order in the run that resumes, as
    accelerate requires for registered objects. ``device_placement``: move batches to
    ``accelerator.device`` (default: ``accelerator.device_placement``).

    Raises ``TypeError`` when ``loader`` is not a feedgpu DataLoader, and
    :class:`~feedgpu.errors.ConfigError` for an ``IterableDataset``, ``split_batches``,
    ``dispatch_batches``, XLA, or tensor/context parallelism without the loader's explicit
    ``rank`` and ``world_size``.
    """
    if isinstance(loader, AcceleratedLoader):
        loader = loader.loader
    if not isinstance(loader, DataLoader):
        raise TypeError(f"prepare_data_loader takes a feedgpu.DataLoader, got {type(loader).__name__}: give other "
                        "loaders to accelerator.prepare()")
    _refuse_unsupported(accelerator, loader)
    known = _prepared.get((id(loader), id(accelerator)))
    if known is not None and known.loader is loader and known._accelerator() is accelerator:
        return known
    place = accelerator.device_placement if device_placement is None else device_placement
    wrapped = AcceleratedLoader(loader, device=accelerator.device if place else None,
                                non_blocking=accelerator.non_blocking, num_processes=accelerator.num_processes)
    accelerator.register_for_checkpointing(wrapped)
    wrapped._accelerator = weakref.ref(accelerator)
    _prepared[(id(loader), id(accelerator))] = wrapped
    return wrapped


def prepare(accelerator, *objects, device_placement: list[bool] | None = None):
    """``accelerator.prepare(*objects)`` with every :class:`feedgpu.DataLoader` among them first
    given to :func:`prepare_data_loader` (so ``prepare`` hands it back as itself). Returns what
    ``prepare`` returns (a tuple in the same order, or the object when one is given).
    ``device_placement``: one bool (or None) per object, as ``accelerator.prepare`` takes it;
    raises ``ValueError`` when its length differs, and ``RuntimeError`` if accelerate replaced
    a prepared feedgpu loader (an accelerate that prepares objects it does not know).
    """
    if device_placement is not None and len(device_placement) != len(objects):
        raise ValueError(f"`device_placement` should be a list with {len(objects)} elements (the number of objects "
                         "passed).")
    places = list(device_placement) if device_placement is not None else [None] * len(objects)
    staged = [prepare_data_loader(accelerator, o, p) if isinstance(o, (DataLoader, AcceleratedLoader)) else o
              for o, p in zip(objects, places)]
    out = accelerator.prepare(*staged, device_placement=device_placement)
    for given, got in zip(staged, out if len(staged) > 1 else (out,)):
        if isinstance(given, AcceleratedLoader) and got is not given:
            raise RuntimeError(f"accelerator.prepare() replaced feedgpu's AcceleratedLoader with {type(got).__name__}: "
                               "this accelerate version prepares objects it does not know; use the loader "
                               "prepare_data_loader() returns without giving it to accelerator.prepare()")
    return out
