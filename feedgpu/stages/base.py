"""The stage contract.

A stage is one class, and that class is its whole definition: a registry ``name``, a
``version`` (bumped when its output changes, for cache fingerprints), ``deterministic`` (False
when it draws random numbers), its parameters (the keyword arguments of ``__init__``, with their
defaults and bounds as annotations: :mod:`feedgpu.stages.params`; :meth:`config` gives them back
as plain data), the spec of its output (:meth:`out_spec`), its CPU implementation and,
optionally, its DALI implementation (``has_dali``, ``dali_params``, ``dali``), the arguments it
folds into the batch stage after it on DALI (``dali_folds``) and its torchvision-style
equivalent for ``feedgpu bench``'s torch baseline (:meth:`torch_baseline`). The YAML schema,
``feedgpu stages`` and ``feedgpu pipeline explain`` read it from there, for built-in stages and
for those other packages register (:mod:`feedgpu.stages.registry`) alike. An instance may set
``label`` (a str) to tell itself apart from other stages of its kind in errors and progress
reports (the ``python`` stage names its callable); the default is ``name``.

* :class:`SampleStage` runs on one sample: ``apply(x, rng)`` where ``x`` is a PIL image (RGB)
  after decode (or what the stage before it returned), and ``rng`` is ``None`` for
  deterministic stages. After the pixel cache's cut a stage gets a PIL RGB image, or, when it
  declares ``takes_arrays``, the cached uint8 HWC array as it is (no conversion on a hit). A random stage that declares
  ``draws = k`` (the built-in ones) gets ``k`` uniform draws in ``[0, 1)`` keyed by ``(seed,
  epoch, sample index, stage)`` (:func:`~feedgpu.stages.draws.sample_uniforms`, computed for
  whole batches by the DALI engine; the stage by its draw key,
  :func:`~feedgpu.stages.draws.stage_draw_ids`, so adding a stage of another kind does not change
  its draws); other random stages (custom ones) get a
  ``numpy.random.Generator`` seeded from the same key (:func:`sample_rng`). Either way the output
  does not depend on which worker runs it.
* :class:`BatchStage` turns the fixed-size uint8 HWC images into the batch's final dtype and
  layout: ``write(dst, img)`` writes one sample into its row of the batch buffer (CPU, numpy),
  ``apply_batch(x)`` does the same to a whole ``uint8 NHWC`` tensor on any device (used when the
  stage is placed on the GPU after the copy).
"""
from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..spec import ImageSpec
from .draws import Draws


class Stage:
    """Base of every stage; see the module docstring for the contract."""

    name: ClassVar[str] = "stage"
    version: ClassVar[int] = 1
    deterministic: ClassVar[bool] = True
    #: ``__init__`` parameters a YAML pipeline sets from its ``output`` section (same key names)
    #: rather than from the stage's own keys.
    from_output: ClassVar[tuple[str, ...]] = ()

    def config(self) -> dict[str, Any]:
        """Parameters as plain data (for explain, fingerprints and YAML round trips)."""
        return {}

    def out_spec(self, spec: ImageSpec) -> ImageSpec:
        return spec

    def explain_name(self) -> str:
        """How ``pipeline explain`` names the stage: its ``name``, and a setting that changes what
        it computes from its default (e.g. ``decode (reduce=auto)``, whose pixels are close to,
        not equal to, a full decode's)."""
        return self.name

    def torch_baseline(self) -> list:
        """The torchvision-style callables doing this stage's work the way a plain
        ``torch.utils.data`` user writes it (PIL in, PIL out; a batch stage: PIL in, tensor
        out), for ``feedgpu bench``'s torch baseline (:mod:`feedgpu.bench.torch_baseline`). Stages that do
        not override it have no baseline: the bench then says so and runs without one."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


class SampleStage(Stage):
    #: True when :meth:`dali` implements the stage for NVIDIA DALI (CPU or GPU).
    has_dali: ClassVar[bool] = False
    #: True when :meth:`dali` resizes the window given by the ``roi_start``/``roi_end`` arguments
    #: (float32 ``(y, x)`` pixels) to a fixed size: right after decode, the DALI engine then
    #: decodes only that window (crop-on-decode) and shifts the window into it.
    window_resize: ClassVar[bool] = False

    #: True when :meth:`apply` also takes a uint8 (height, width, 3) RGB array and then returns
    #: an array with the pixels it returns for the PIL image of it (any strides: a view will
    #: do). After the pixel cache the stage then gets the cached array as it is; False (the
    #: default): a PIL RGB image.
    takes_arrays: ClassVar[bool] = False

    def apply(self, x: Any, rng: np.random.Generator | None) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    #: Uniform draws per sample a random stage takes (see the module docstring); 0: the stage
    #: gets a ``numpy.random.Generator`` instead. A subclass of a built-in random stage that
    #: overrides ``apply`` gets the same draws (``rng[j]``, floats in [0, 1)); one that wants a
    #: Generator sets ``draws = 0`` (it then runs on the Python engine only).
    draws: ClassVar[int] = 0
    #: DALI graph fusion: ``{batch stage name: {argument of my dali_params: argument of the batch
    #: stage's dali}}``. When this stage comes right before that batch stage, the DALI engine
    #: does not run :meth:`dali`, it passes those arguments to the batch stage instead
    #: (``horizontal_flip``'s ``flip`` becomes ``normalize``'s ``mirror``).
    dali_folds: ClassVar[dict[str, dict[str, str]]] = {}

    def dali_fold(self, batch_stage: "Stage | None") -> dict[str, str] | None:
        """The argument renaming of :attr:`dali_folds` for ``batch_stage`` (``None``: no fusion)."""
        if batch_stage is None:
            return None
        return self.dali_folds.get(batch_stage.name)

    # -- DALI implementation (see feedgpu.exec.dali.engine) ---------------------------------------
    # Random parameters are computed in Python for a whole batch from the same draws ``apply``
    # gets, then fed to DALI per sample, so both engines crop, flip ... identically.
    def dali_params(self, sizes: np.ndarray, u: np.ndarray | None) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """DALI arguments for a batch of inputs of ``sizes`` (int64 ``(n, 2)``: width, height in
        pixels) given its draws ``u`` (float64 ``(n, draws)``, ``None`` for deterministic stages):
        ``({name: array (n, ...)}, output sizes (n, 2))``; row ``i`` of each array is sample
        ``i``'s argument."""
        return {}, sizes

    def dali(self, x, args: dict, device: str):  # pragma: no cover - abstract
        """DALI graph for the stage: ``x`` is an HWC uint8 DataNode, ``args`` the DataNodes of
        :meth:`dali_params` by name; ``device`` is ``"cpu"`` or ``"gpu"``."""
        raise NotImplementedError


class BatchStage(Stage):
    has_dali: ClassVar[bool] = False

    def write(self, dst: np.ndarray, img: np.ndarray) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def dali(self, x, args: dict, device: str):  # pragma: no cover - abstract
        raise NotImplementedError

    def apply_batch(self, x):  # pragma: no cover - abstract
        raise NotImplementedError


def sample_rng(seed: int, epoch: int, index: int, stage_pos: int) -> np.random.Generator:
    """The generator a random stage without ``draws`` gets for one sample (PCG64 via SeedSequence)."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, int(epoch), int(index), int(stage_pos)])


def stage_random(stage: Stage, seed: int, epoch: int, index: int, stage_pos: int):
    """What ``stage.apply`` gets as ``rng`` for one sample: ``None`` (deterministic), its
    uniform draws (:class:`~feedgpu.stages.draws.Draws`) or a :func:`sample_rng` generator."""
    if stage.deterministic:
        return None
    if getattr(stage, "draws", 0):
        return Draws(seed, epoch, index, stage_pos)
    return sample_rng(seed, epoch, index, stage_pos)
