"""feedgpu's recorded benchmarks, run from the repository root as ``python -m bench.<name>``
(see ``bench/README.md``); :mod:`bench.harness` holds what they share."""
