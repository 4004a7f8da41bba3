"""The map-style worker pool: processes that run a :class:`~feedgpu.exec.contract.Work`'s tasks.

- :mod:`.process_pool`: :class:`~feedgpu.exec.pool.process_pool.ProcessPool`, the main process's
  side: spawn, submit, results in any order, resize, death and timeout detection, shutdown.
- :mod:`.worker`: what runs in a worker process (the task loop, its hooks, results or packed
  exceptions on the result channel).
- :mod:`.processes`: :class:`~feedgpu.exec.pool.processes.WorkerProcesses`, the process core
  that this pool and the IterableDataset workers (:mod:`feedgpu.exec.iterable`) share: start,
  stuck forks, deaths, a close that never hangs. Each pool keeps its own transport and scheduling.
- :mod:`.start`: how workers start (multiprocessing context, base seed and seeding, a fork's
  time bound); :mod:`.lifetime`: a worker's exit when the main process is gone, ending
  processes that do not stop. Both are shared with the IterableDataset workers.
- :mod:`.errors`: a worker's exception packed and rebuilt in the main process, a dead worker's
  exit and a timeout worded as torch words them, for both pools.
- :mod:`.fd_channel`: the result channel that carries shared-memory tensors' descriptors;
  :mod:`.fd_limit`: running out of descriptors, reported as torch reports it.
"""
