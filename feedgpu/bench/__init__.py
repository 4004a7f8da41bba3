"""``feedgpu bench``'s measurement, kept out of the library's core: nothing in ``feedgpu``
outside this package imports it.

* :mod:`~feedgpu.bench.runner`: the two runs (loaders side by side; why is my GPU idle);
* :mod:`~feedgpu.bench.subjects`: the loaders under test (feedgpu's engines, the torch baseline);
* :mod:`~feedgpu.bench.measure`: one run's numbers, alternating rounds, medians;
* :mod:`~feedgpu.bench.torch_baseline`: the torch DataLoader + Pillow doing a pipeline's work;
* :mod:`~feedgpu.bench.idle`: the three phases behind "why is my GPU idle";
* :mod:`~feedgpu.bench.models`: ResNet models for ``--model``;
* :mod:`~feedgpu.bench.machine`: what a run ran on (machine, data);
* :mod:`~feedgpu.bench.report`: results as text.

``feedgpu.cli.bench`` parses the options and calls :mod:`~feedgpu.bench.runner`; the recorded
benchmarks under ``bench/`` reuse these modules. Importing the package imports none of them.
"""
