"""Lightning 2.6 on the CPU with 2 processes: ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``.

Lightning's ddp strategy starts rank 1 itself by running this script again (same arguments,
``LOCAL_RANK=1``); gloo is its backend on the CPU. Every rank records, for each fit, the sample
indices of every batch its ``training_step`` got, with the epoch (``fwcommon.Records``).

    python lightning_run.py KIND SCENARIO OUT_DIR FOLDER CKPT_DIR

SCENARIO:
  fit     loaders built BEFORE the Trainer (before any process group exists) and passed to
          fit(), then built inside ``train_dataloader()``: the index dataset and the image
          folder, 2 epochs each. The dataset runs and inside_pipeline save a ModelCheckpoint
          every 2 steps (step 2 is mid-epoch 0). torch's runs that are resumed use
          ResumableTorchLoader (plain torch has no loader state, so Lightning restarts the
          epoch; recorded by resuming run ``before_dataset``, as ``resume_plain``).
  resume  fit(ckpt_path=CKPT_DIR/<run>/step=2.ckpt) on 2 ranks with fresh loaders, built the
          same way as in the run that saved the checkpoint.
  workers seed_everything(42, workers=True) and num_workers=2, both kinds of data, loaders
          built inside ``train_dataloader()`` (where sharding does not depend on the process
          group's timing); the dataset draws one number per sample from NumPy's global RNG
          inside the worker. Last, the dataset again after seed_everything(0, workers=True).
"""
from __future__ import annotations

import sys
import warnings

import fwcommon as fw

KIND, SCENARIO, OUT, FOLDER, CKPT = sys.argv[1:6]
N_DATASET = 21      # DistributedSampler pads it to 22 (1 repeated sample per epoch)
BATCH = 3
EPOCHS = 2
CKPT_EVERY = 2      # steps; step 2 is in the middle of epoch 0 (4 batches per rank)

import lightning as L  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # 2 ranks (and their workers) share the machine's cores
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*number of training batches.*")


class Model(L.LightningModule):
    def __init__(self, rec: dict):
        super().__init__()
        self.rec = rec
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        x = batch[0].float().reshape(len(batch[0]), -1).mean(1, keepdim=True)
        self.rec["batches"].append([self.current_epoch, batch_idx, fw.indices(batch), fw.draws(batch)])
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.001)


class ModelBuildsLoader(Model):
    def __init__(self, rec: dict, make):
        super().__init__(rec)
        self.make = make

    def train_dataloader(self):
        loader = self.make()
        self.rec["built_inside"] = True
        return loader


def trainer(name: str, ckpt: bool = False) -> L.Trainer:
    cbs = [ModelCheckpoint(dirpath=f"{CKPT}/{name}", filename="{step}", every_n_train_steps=CKPT_EVERY,
                           save_top_k=-1)] if ckpt else []
    return L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     enable_checkpointing=ckpt, callbacks=cbs, default_root_dir=f"{OUT}/root")


def loader(data: str, workers: int = 0, resumable: bool = False, draws: bool = False):
    return fw.make_loader(KIND, data, n=N_DATASET, folder=FOLDER, batch_size=BATCH, num_workers=workers,
                          resumable=resumable, draws=draws)


def main() -> int:
    records = fw.Records(OUT)
    L.seed_everything(42, workers=SCENARIO == "workers")
    # (name, loader built now or a factory called inside train_dataloader(), checkpointing, ckpt_path)
    runs: list = []
    step = f"step={CKPT_EVERY}.ckpt"
    torch_only = KIND == "torch"
    if SCENARIO == "fit":
        runs = [("before_dataset", loader("dataset"), True, None)]
        if torch_only:
            runs.append(("before_dataset_resumable", loader("dataset", resumable=True), True, None))
        runs += [("before_pipeline", loader("pipeline"), False, None),
                 ("inside_dataset", lambda: loader("dataset", resumable=True), True, None),
                 ("inside_pipeline", lambda: loader("pipeline", resumable=True), True, None)]
    elif SCENARIO == "resume":
        saved = "before_dataset_resumable" if torch_only else "before_dataset"
        runs = [("resume_before", loader("dataset", resumable=True), False, f"{CKPT}/{saved}/{step}"),
                ("resume_inside", lambda: loader("dataset", resumable=True), False, f"{CKPT}/inside_dataset/{step}"),
                ("resume_inside_pipeline", lambda: loader("pipeline", resumable=True), False,
                 f"{CKPT}/inside_pipeline/{step}")]
        if torch_only:
            runs.append(("resume_plain", loader("dataset"), False, f"{CKPT}/before_dataset/{step}"))
    elif SCENARIO == "workers":
        runs = [("workers_dataset", lambda: loader("dataset", workers=2, draws=True), False, None),
                ("workers_pipeline", lambda: loader("pipeline", workers=2), False, None),
                ("workers_seed0", lambda: loader("dataset", workers=2, draws=True), False, None)]
    else:
        raise SystemExit(f"unknown scenario {SCENARIO}")
    for name, made, ckpt, ckpt_path in runs:
        if name == "workers_seed0":  # a base seed below the worker ids (Lightning subtracts the worker id)
            L.seed_everything(0, workers=True)
        rec = records.new(name)
        t = trainer(name, ckpt)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if callable(made) and not hasattr(made, "__iter__"):
                    t.fit(ModelBuildsLoader(rec, made), ckpt_path=ckpt_path)
                else:
                    t.fit(Model(rec), made, ckpt_path=ckpt_path)
            rec["warnings"] = sorted({str(w.message) for w in seen if "resum" in str(w.message)})
            if t.train_dataloader is not None:
                rec["loader"] = fw.describe(t.train_dataloader)
                sampler = getattr(t.train_dataloader, "sampler", None)
                rec["sampler"] = type(sampler).__name__ if sampler is not None else None
        except BaseException:  # noqa: BLE001 - recorded for the driver, then this rank stops
            records.fail(rec)
            records.save(t.global_rank)
            return 1
        records.save(t.global_rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
