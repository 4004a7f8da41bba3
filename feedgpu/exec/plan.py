"""The planner: where each stage of a pipeline runs and what shape the batch has."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..imaging import pil_label
from ..spec import BYTES, ImageSpec
from ..stages.base import BatchStage, SampleStage, Stage
from ..stages.draws import stage_draw_ids


@dataclass(frozen=True)
class Step:
    stage: Stage
    where: str          # "cpu pool" (worker processes) or the output device (e.g. "cuda:0")
    out: ImageSpec


@dataclass(frozen=True)
class CacheCut:
    """Where a pixel cache cuts a plan, and what it stores there.

    Attributes:
        after: the leading sample stages whose output is stored (the deterministic prefix, at
            least one); on a hit they are not run, nor is the source read.
        stage: the label of the last of them.
        stores: the spec of what is stored per sample: uint8 HWC RGB (``height``/``width``
            ``None`` while they depend on the input), one array per sample.
    """

    after: int
    stage: str
    stores: ImageSpec

    def describe(self, cache=None) -> tuple[str, str, str, str]:
        """The cache's row of :meth:`Plan.describe`; ``cache``: its settings (``dir``,
        ``compression``), or None."""
        where = "local disk (Arrow IPC)"
        if cache is not None and hasattr(cache, "dir"):
            where = f"local disk (Arrow IPC, {cache.compression}): {cache.dir}"
        return ("[cache]", "-", where, "-", f"{self.stores.describe()} stored after {self.stage}")


@dataclass(frozen=True)
class Plan:
    """Stages in order with where they run; ``sample_stages`` run per sample in the CPU pool,
    ``batch_stage`` (normalize, or None) runs in the pool for CPU output or on the device after
    the host-to-device copy (so uint8 crosses PCIe, 4x fewer bytes than float32)."""

    steps: tuple[Step, ...]
    sample_stages: tuple[SampleStage, ...]
    batch_stage: BatchStage | None
    batch_on_device: bool
    pool_spec: ImageSpec     # per-sample spec the pool writes into shared memory
    out_spec: ImageSpec      # per-sample spec the training loop receives
    device: str
    cache_prefix: int = 0    # leading deterministic sample stages whose output may be cached
    draw_ids: tuple[int, ...] = ()   # each sample stage's draw key (stages.draws.stage_draw_ids)

    @property
    def cache_cut(self) -> CacheCut | None:
        """Where a cache cuts this plan (after its leading deterministic stages), or None when
        there are none: nothing to cache."""
        k = self.cache_prefix
        if k == 0:
            return None
        last = self.sample_stages[k - 1]
        return CacheCut(k, getattr(last, "label", last.name), self.steps[k - 1].out.with_(dtype="uint8", layout="HWC"))

    def describe(self, batch_size: int, cached=False) -> list[tuple[str, str, str, str, str]]:
        """Rows ``(stage, kind, runs on, deterministic, output per sample)``: the source, each
        stage and, with ``cached`` (True, or the cache settings to show its directory and
        compression), the cache as a step at its cut (:class:`CacheCut`). ``kind`` is the
        stage's kind as ``feedgpu stages`` names it (``sample`` or ``batch``); a random stage is
        ``no (seeded)``: its draws are keyed by (seed, epoch, sample index), so the same seed
        gives the same output whichever worker runs it."""
        rows = [("source", "-", "cpu pool (read)", "-", BYTES.describe())]
        for i, s in enumerate(self.steps):
            kind = "batch" if isinstance(s.stage, BatchStage) else "sample"
            rows.append((s.stage.explain_name(), kind, s.where, "yes" if s.stage.deterministic else "no (seeded)",
                         s.out.describe()))
            if cached and i + 1 == self.cache_prefix:
                rows.append(self.cache_cut.describe(None if cached is True else cached))
        return rows


def make_plan(stages: list[Stage], device: str, pool_where: str | None = None,
              batch_on_device: bool | None = None, batch_where: str | None = None) -> Plan:
    """Split ``stages`` into per-sample CPU stages and an optional final batch stage.

    ``pool_where`` names where the sample stages run (default: the CPU pool with the PIL build
    they use); ``batch_where`` where the batch stage runs when it stays off the device (default:
    ``pool_where`` when given, else the CPU pool, in numpy: a batch stage does not use PIL).

    Raises :class:`ConfigError` when a batch stage is not last, no decode comes first, or the
    image size is not fixed by the end (add a crop stage).
    """
    if not stages or stages[0].name != "decode":
        raise ConfigError("stages: the first stage must be 'decode'")
    sample: list[SampleStage] = []
    batch: BatchStage | None = None
    for i, st in enumerate(stages):
        if isinstance(st, BatchStage):
            if i != len(stages) - 1:
                raise ConfigError(f"stages[{i}] ({st.name}): a batch stage must be the last stage")
            batch = st
        elif isinstance(st, SampleStage):
            sample.append(st)
        else:
            raise ConfigError(f"stages[{i}]: {st!r} is not a feedgpu stage")
    on_device = batch is not None and device != "cpu" if batch_on_device is None else batch_on_device
    batch_where = batch_where or pool_where or "cpu pool (numpy)"
    pool_where = pool_where or f"cpu pool ({pil_label()})"
    spec = BYTES
    steps = []
    for st in sample:
        spec = st.out_spec(spec)
        steps.append(Step(st, pool_where, spec))
    pool_spec = spec
    if not pool_spec.fixed:
        raise ConfigError("stages: the image size is not fixed at the end of the pipeline; "
                          "add random_resized_crop or resize_center_crop (batches need one shape)")
    if batch is not None:
        spec = batch.out_spec(spec)
        steps.append(Step(batch, device if on_device else batch_where, spec))
    prefix = 0
    while prefix < len(sample) and sample[prefix].deterministic:
        prefix += 1
    return Plan(tuple(steps), tuple(sample), batch, on_device, pool_spec if on_device else spec, spec, device,
                prefix, stage_draw_ids(sample))
