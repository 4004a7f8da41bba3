"""NVIDIA DALI as an engine for a pipeline's built-in stages (CPU or GPU), in the main process.

- :mod:`.engine`: :class:`~feedgpu.exec.dali.engine.DaliWork`, the running engine (the
  :class:`~feedgpu.exec.contract.Work` the loader drives, its lookahead window, the hand-over).
- :mod:`.graph`: whether DALI is there, which plans it runs, the graph of one group of samples.
- :mod:`.prepare`: the Python side of a batch (read, header checks, groups, per-sample arguments).

Nothing here imports ``nvidia.dali`` at module level: ``import feedgpu`` works without DALI.
"""
