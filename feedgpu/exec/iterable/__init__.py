"""A torch ``IterableDataset`` run the way torch's ``DataLoader`` runs it.

- :mod:`.runner`: :class:`~feedgpu.exec.iterable.runner.IterableRunner`, the loader's side: the
  passes, batching, ``state_dict``, ``timeout``, pinning.
- :mod:`.pool`: :class:`~feedgpu.exec.iterable.pool.WorkerSet`, the worker processes seen from
  the main process (credits, death and timeout detection, shutdown).
- :mod:`.worker`: the worker side (the stream's batching, a worker's loop and its messages).
- :mod:`.datapipes`: torch's handling of an ``IterDataPipe`` (shuffle, seeds, sharding).
"""
