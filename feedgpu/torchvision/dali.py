"""``engine="dali"`` for a torchvision dataset: its recipe as a feedgpu pipeline on DALI.

DALI runs feedgpu's own stages (DALI's JPEG decoder and resize, on the CPU with
``device_id=None`` or on the GPU), not torchvision's kernels, so this is taken only when the
whole recipe has a stage of its own (:func:`~feedgpu.torchvision.pipeline_out.pipeline_config`
leaves nothing out) and nothing around it needs a Dataset (``Subset``, ``target_transform``,
``collate_fn``); otherwise :class:`~feedgpu.errors.ConfigError` says what stands in the way.
The pipeline gets torch's defaults (batch size 1, no shuffle, no workers, batches on the CPU)
so the loader's arguments mean what they mean for torch's loader; batches are
:class:`~feedgpu.exec.work.Batch` ``(images, labels)``. Pixels are DALI's: within about a level
of torchvision's on average (resampling), not equal. The recipe is converted when the loader is
built: a transform changed later is refused when the next iteration starts
(:func:`feedgpu.torchvision.backend.refuse_changed_origin`, given the dataset and its
:func:`~feedgpu.torchvision.recognise.dataset_key` when the loader was built), never run as it
was silently.
"""
from __future__ import annotations

from ..errors import ConfigError
from .pipeline_out import pipeline_config
from .recognise import recognise

__all__ = ["dali_pipeline"]

#: what pipeline_config may leave out and DALI still runs with torchvision's meaning
_ACCEPTED = ("Resize + CenterCrop: resize_center_crop",)


def _wants_dali(engine) -> bool:
    if engine is None:
        return False
    name = engine if isinstance(engine, str) else getattr(engine, "name", None) or (
        engine.get("name") if isinstance(engine, dict) else None)
    return name == "dali"


def dali_pipeline(dataset, engine, compile: bool = True, collate_fn=None):
    """``dataset`` as a :class:`~feedgpu.Pipeline` on ``engine`` when ``engine`` is DALI and
    ``dataset`` a torchvision dataset feedgpu compiles; else None. Raises :class:`ConfigError`
    when DALI is asked for a torchvision dataset it cannot run whole."""
    if not _wants_dali(engine) or not compile:
        return None
    found, _ = recognise(dataset)
    if found is None:
        return None
    data, left_out = pipeline_config(dataset)
    blocking = [x for x in left_out if not x.startswith(_ACCEPTED)]
    if collate_fn is not None:
        blocking.append("collate_fn: DALI assembles the batches")
    if blocking:
        raise ConfigError("engine='dali' runs a torchvision dataset only when feedgpu has a stage for all of it; "
                          "here: " + "; ".join(blocking) + ". Leave engine out (the Python engine compiles what it "
                          "can and runs the rest as your objects)")
    import torch

    from ..pipeline import Pipeline

    seed = int(torch.empty((), dtype=torch.int64).random_().item())   # as torch's loader: a new seed per loader
    data["loader"] = {"batch_size": 1, "shuffle": False, "drop_last": False, "num_workers": 0,
                      "persistent_workers": False, "seed": seed, "on_error": "raise"}
    data["output"]["device"] = "cpu"
    return Pipeline.from_config(data, where=f"{type(found.base).__name__} (torchvision, engine dali)")

