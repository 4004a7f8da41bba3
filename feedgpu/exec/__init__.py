"""The execution side: a batch's indices turned into a batch, in worker processes or in DALI, and
its memory handed to the training loop without a copy.

- :mod:`.contract`: the engine contract (``Work``, ``Pool``, ``Elastic``, ``RunsAhead``; ``Task``, ``Result``,
  ``Control``) between the epoch runner, the work and the pool.
- :mod:`.work`, :mod:`.assemble`, :mod:`.steps`, :mod:`.cache_step`, :mod:`.plan`,
  :mod:`.pixels`: the Python engine (a pipeline's samples through its steps, or a torch
  ``Dataset`` and its ``collate_fn``).
- :mod:`.pool`: the process core (the map-style ``ProcessPool``; start, lifetime, errors).
- :mod:`.iterable`: an ``IterableDataset`` run as torch runs it.
- :mod:`.dali`: DALI as an engine.
- :mod:`.buffers`: batch memory recycled once the training loop lets go of it.
- :mod:`.balancer`: the pure policy of ``num_workers: auto``.
- :mod:`.progress`: each worker's progress slot, for timeout and death messages.
"""
