"""The map-style worker pool: processes that run a :class:`~feedgpu.exec.contract.Work`'s tasks.

- :mod:`.process_pool`: :class:`~feedgpu.exec.pool.process_pool.ProcessPool`, the main process's
  side: spawn, submit, results in any order, resize, death and timeout detection, shutdown.
- :mod:`.worker`: what runs in a worker process (torch's worker start, the task loop, the
  parent watch that ends an orphan).
- :mod:`.start`: how workers start (multiprocessing context, base seed, a fork's time bound).
- :mod:`.errors`: a worker's exception rebuilt in the main process, a dead worker's exit worded
  as torch words it.
- :mod:`.fd_channel`: the result channel that carries shared-memory tensors' descriptors;
  :mod:`.fd_limit`: running out of descriptors, reported as torch reports it.
"""
