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
(:func:`refuse_changed_recipe`, given the dataset and its :func:`recipe_key` when the loader
was built), never run as it was silently.

The pipeline reads the dataset's ``root`` with feedgpu's folder source, so it is taken only
when that source lists the dataset's own ``samples``: the same files, in the same order, with
the same labels. A dataset made with ``is_valid_file`` or an overridden ``find_classes``, whose
``samples`` were edited, or whose folder the folder source reads otherwise (hidden folders,
other file endings: :mod:`feedgpu.sources.folder`) is refused with what differs; ``samples``
edited after the loader was built are a change like a transform's.
"""
from __future__ import annotations

import os

from ..errors import ConfigError
from .pipeline_out import pipeline_config
from .recognise import dataset_key, recognise, same_key

__all__ = ["dali_pipeline", "recipe_key", "refuse_changed_recipe"]

#: what pipeline_config may leave out and DALI still runs with torchvision's meaning
_ACCEPTED = ("Resize + CenterCrop: resize_center_crop",)


def _wants_dali(engine) -> bool:
    if engine is None:
        return False
    name = engine if isinstance(engine, str) else getattr(engine, "name", None) or (
        engine.get("name") if isinstance(engine, dict) else None)
    return name == "dali"


def dali_pipeline(dataset, engine, compile: bool = True, collate_fn=None, unbatched: bool = False):
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
    if unbatched:
        blocking.append("batch_size=None: DALI assembles whole batches")
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
    pipe = Pipeline.from_config(data, where=f"{type(found.base).__name__} (torchvision, engine dali)")
    differs = _other_samples(found.base.samples, pipe.source)
    if differs:
        raise ConfigError(f"engine='dali' reads the {type(found.base).__name__}'s root with feedgpu's folder source, "
                          f"which lists other samples than the dataset: {differs} (is_valid_file, find_classes, "
                          "edited samples, hidden folders or other file endings). Leave engine out: the Python "
                          "engine reads the dataset's own samples")
    return pipe


def _other_samples(samples, source) -> str | None:
    """None when ``source`` (a folder source) lists ``samples`` (``[(path, label)]``) in order,
    else the first difference, in words."""
    n = len(source.labels)
    if len(samples) != n:
        return f"{len(samples)} samples in the dataset, {n} images in the folder source"
    for i, (path, label) in enumerate(samples):
        mine, mine_label = source.key(i), int(source.labels[i])
        if os.path.normpath(path) != os.path.normpath(mine) or int(label) != mine_label:
            return f"sample {i} is {path!r} with label {label} in the dataset, {mine!r} with label {mine_label} there"
    return None


def recipe_key(dataset) -> tuple:
    """What the DALI pipeline made from ``dataset`` depends on: its
    :func:`~feedgpu.torchvision.recognise.dataset_key` (the objects and the transform's repr) and
    its ``samples`` (the list object, its length and a hash of its entries)."""
    samples = getattr(dataset, "samples", None)
    return dataset_key(dataset), (id(samples), len(samples), hash(tuple(map(tuple, samples)))) if samples is not None \
        else None


def refuse_changed_recipe(dataset, key: tuple) -> None:
    """Raise :class:`ConfigError` naming what changed (``transform``, ``target_transform``,
    ``loader``, ``samples``) when ``dataset``'s :func:`recipe_key` is no longer ``key``: the
    pipeline holds the recipe as it was, and running it would give other samples than torch's
    loader gives."""
    now = recipe_key(dataset)
    if same_key(key[0], now[0]) and key[1] == now[1]:
        return
    (objs, text), (new_objs, new_text) = key[0], now[0]
    changed = [name for name, k in (("transform", -3), ("target_transform", -2), ("loader", -1))
               if objs[k] is not new_objs[k]]
    if "transform" not in changed and text != new_text:
        changed.insert(0, "transform")
    if key[1] != now[1]:
        changed.append("samples")
    what = " and ".join(changed) or "recipe"
    raise ConfigError(f"engine='dali': the {type(dataset).__name__}'s {what} changed since the loader was built, and "
                      "DALI runs the recipe as it was then; build a new feedgpu.DataLoader for the new recipe (or "
                      "leave engine out: the Python engine follows the dataset at each iteration)")

