"""accelerate 1.15 under torchrun, 2 CPU processes over gloo:

    python -m torch.distributed.run --nproc-per-node 2 --standalone accelerate_run.py KIND SCENARIO OUT_DIR FOLDER STATE_DIR

The loaders are built BEFORE ``Accelerator()`` (before the process group exists), then
``model, optimizer, loader = accelerator.prepare(model, optimizer, loader)`` (the script keeps no
other reference to the loader it built, as a user's script does not); for KIND ``feedgpu`` the
loader goes through ``feedgpu.integrations.accelerate.prepare_data_loader(accelerator, loader)``
first (the documented idiom: ``prepare()`` then hands feedgpu's loader back instead of
rebuilding it as torch's). Training runs under ``gradient_accumulation_steps=2`` inside
``accelerator.accumulate(model)``, 2 epochs, with ``loader.set_epoch(epoch)`` each epoch. Every
rank records, per batch, the epoch, the batch number in the epoch, the sample indices and
``accelerator.sync_gradients``; for feedgpu also the worker processes its loader ran while the
first batch was out and its ``stats()`` at the end.

SCENARIO:
  train   the index dataset (18 samples, batch 2, 2 workers: 9 batches, so accelerate's
          even_batches gives each rank 5, an odd number, rank 1's 5th batch repeating the epoch's
          first; feedgpu: 9 samples per rank, 5 batches, the last of 1) with
          ``accelerator.save_state(STATE_DIR)`` after batch 2 of epoch 0; then the image folder
          (20 images, 2 workers: 5 batches per rank, nothing repeated); for feedgpu then
          ``plain``: its loader given to ``prepare()`` without ``prepare_data_loader`` (accelerate
          rebuilds it).
  resume  the index dataset again: ``accelerator.load_state(STATE_DIR)``, then for torch epoch 0
          through ``accelerator.skip_first_batches(loader, 2)`` (accelerate's idiom for its own
          loaders) and epoch 1 through the loader; for feedgpu (prepared in one call,
          ``feedgpu.integrations.accelerate.prepare(accelerator, model, optimizer, loader)``) both
          epochs through the loader (``load_state`` restored its position).
"""
from __future__ import annotations

import gc
import sys

import fwcommon as fw

KIND, SCENARIO, OUT, FOLDER, STATE = sys.argv[1:6]
N_DATASET = 18
BATCH = 2
EPOCHS = 2
SAVE_AFTER = 2      # batches of epoch 0
WORKERS = 2

import torch  # noqa: E402

torch.set_num_threads(1)  # 2 ranks (and their workers) share the machine's cores
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402


def train(acc: Accelerator, rec: dict, box: list, save: bool = False, resume: bool = False,
          plain: bool = False) -> None:
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    # as in a user's script, nothing but ``prepare``'s result refers to the loader afterwards
    loader = box.pop()
    if KIND == "feedgpu" and resume:   # the one-call form
        from feedgpu.integrations.accelerate import prepare

        model, opt, loader = prepare(acc, model, opt, loader)
    else:
        if KIND == "feedgpu" and not plain:
            from feedgpu.integrations.accelerate import prepare_data_loader

            loader = prepare_data_loader(acc, loader)
        model, opt, loader = acc.prepare(model, opt, loader)
    gc.collect()
    rec["loader"] = fw.describe(loader)
    rec["length"] = len(loader)
    if resume:
        acc.load_state(STATE)
    for epoch in range(EPOCHS):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        skip = SAVE_AFTER if resume and epoch == 0 else 0
        # feedgpu's loader resumes by itself (load_state restored it); accelerate's skips
        active = acc.skip_first_batches(loader, skip) if skip and KIND == "torch" else loader
        for i, batch in enumerate(active, start=skip):
            if i == skip and epoch == 0 and hasattr(loader, "worker_pids"):
                rec["workers"] = len(loader.worker_pids())   # feedgpu's pool, while a batch is out
            with acc.accumulate(model):
                x = batch[0].float().reshape(len(batch[0]), -1).mean(1, keepdim=True)
                loss = model(x).pow(2).mean()
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                rec["batches"].append([epoch, i, fw.indices(batch), bool(acc.sync_gradients)])
            if save and epoch == 0 and i == SAVE_AFTER - 1:
                acc.save_state(STATE)
    if hasattr(loader, "stats"):
        rec["stats"] = {k: loader.stats()[k] for k in ("batches", "samples")}


def main() -> int:
    set_seed(42)
    records = fw.Records(OUT)

    def loader(data: str, workers: int = WORKERS):
        return fw.make_loader(KIND, data, n=N_DATASET, folder=FOLDER, batch_size=BATCH, num_workers=workers)

    if SCENARIO == "train":
        runs = [("dataset", [loader("dataset")], {"save": True}), ("pipeline", [loader("pipeline")], {})]
        if KIND == "feedgpu":
            runs.append(("plain", [loader("dataset", 0)], {"plain": True}))
    elif SCENARIO == "resume":
        runs = [("resume", [loader("dataset")], {"resume": True})]
    else:
        raise SystemExit(f"unknown scenario {SCENARIO}")
    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    for name, made, how in runs:
        rec = records.new(name)
        try:
            train(acc, rec, made, **how)
        except BaseException:  # noqa: BLE001 - recorded for the driver, then this rank stops
            records.fail(rec)
            records.save(acc.process_index)
            return 1
        records.save(acc.process_index)
    acc.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
