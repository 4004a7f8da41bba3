"""Running the pipeline's work on Ray as well as in local processes.

* :mod:`.ray_workers`: :class:`~feedgpu.exec.remote.ray_workers.RemoteWorkers`, Ray actors running
  a work's handler on tasks (Ray is imported there only, when a pipeline asks for it).
* :mod:`.mixed_pool`: :class:`~feedgpu.exec.remote.mixed_pool.MixedPool`, one pool over local
  worker processes and remote workers; each task goes to whichever is free.

``import feedgpu`` does not import this package.
"""
