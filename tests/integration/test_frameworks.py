"""Real frameworks with 2 processes over gloo on the CPU: Lightning 2.6
(``Trainer(accelerator="cpu", devices=2, strategy="ddp")``, which starts rank 1 itself by running
the script again) and accelerate 1.15 under torchrun (``accelerator.prepare``).

Every scenario runs twice with the same script: with ``torch.utils.data.DataLoader`` (the
reference; it must pass, which proves the harness) and with ``feedgpu.DataLoader`` (the
drop-in claim). The scripts (``tests/integration/frameworks/``) record per rank the sample indices of every
batch the training step got; the tests here check the records:

* the ranks' samples of each epoch are disjoint and cover the dataset once, apart from the
  padding the framework documents: torch's ``DistributedSampler`` (Lightning) repeats the
  head of the epoch's order until every rank has as many samples (21 samples: 1 repeated);
  accelerate's ``even_batches`` gives every rank as many full batches by repeating the epoch's
  first batches (18 samples in batches of 2: 2 repeated);
* a mid-epoch checkpoint saved by the framework and resumed on 2 ranks continues exactly: the
  batches before the checkpoint followed by those after the resume are the uninterrupted run's;
* ``seed_everything(42, workers=True)`` (and with seed 0, below the worker ids) with
  ``num_workers=2`` trains, and the workers' NumPy streams differ (over workers and ranks);
* with accelerate's ``gradient_accumulation_steps=2`` and an odd number of batches, the last
  batch of each epoch is a sync step.

Under accelerate the feedgpu scripts give the loader to
``feedgpu.integrations.accelerate.prepare_data_loader`` before ``accelerator.prepare(model,
optimizer, loader)``, so feedgpu's loader (its worker pool, its sharding: 18 samples over 2
ranks is 9 each, nothing repeated) does the work; the tests also check that its pool ran, that
its sync flags are torch's, that the resumed run's flags are the uninterrupted run's, and what
``prepare()`` does to a feedgpu loader given without that line (rebuilds it as torch's).

Plain torch's DataLoader has no state, so Lightning restarts an interrupted epoch from its first
batch (it warns); the resumed torch runs therefore use ``ResumableTorchLoader`` (torch's loader
with the ``state_dict`` pair Lightning asks for), and one test records plain torch's restart.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import PHOTOS, REPO

# the dev extra: missing, the module fails to collect (not a skip); the frameworks run only in the scripts
_missing = [m for m in ("lightning", "accelerate") if importlib.util.find_spec(m) is None]
if _missing:
    raise ImportError(f"tests/integration/test_frameworks.py needs {_missing} (pip install -e '.[dev]', scripts/setup.sh does)")

FW = Path(__file__).resolve().parent / "frameworks"
sys.path.insert(0, str(FW))
import fwcommon  # noqa: E402

pytestmark = pytest.mark.timeout(600)
KINDS = ("torch", "feedgpu")
EPOCHS = 2
N_IMAGES = 20             # the image folder: one class per image, so a label is the index
LAUNCH_TIMEOUT = 240      # seconds for one 2-process launch (a hang is reported, not waited out)
# (samples, samples delivered per epoch over both ranks, padding included)
LIGHTNING_DATASET = (21, 22)
LIGHTNING_PIPELINE = (N_IMAGES, N_IMAGES)
ACCELERATE_DATASET = {"torch": (18, 20), "feedgpu": (18, 18)}   # feedgpu pads only up to a multiple of ranks
ACCELERATE_PIPELINE = (N_IMAGES, N_IMAGES)
ACCELERATE_BATCHES = 5    # per rank and epoch, both loaders (the last one partial with feedgpu)
RESUMED_AFTER = 2         # batches of epoch 0 before the checkpoint (both scripts)


#: feedgpu cases that fail today, each with what was seen (strict: they turn red once fixed).
XFAIL: dict = {}  # (test, loader, case) -> reason, for feedgpu cases known to fail (strict xfail)


def cases(test: str, names: str, values: list[tuple]):
    """``parametrize(names, values)``, marking the values listed in XFAIL under ``test``."""
    return pytest.mark.parametrize(names, [
        pytest.param(*v, marks=pytest.mark.xfail(strict=True, reason=XFAIL[(test, *v)])) if (test, *v) in XFAIL
        else pytest.param(*v) for v in values])


RESUMED = [(k, d, b) for k in KINDS for d, b in (("dataset", "before"), ("dataset", "inside"), ("pipeline", "inside"))]
DATA_BUILT = [(k, d, b) for k in KINDS for d in ("dataset", "pipeline") for b in ("before", "inside")]


# -- launching ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("frameworks")
    fwcommon.build_folder(PHOTOS, base / "images", N_IMAGES)
    return base


_launched: dict = {}


def _launch_once(cmd: list[str], out: Path) -> dict:
    """Run one 2-process job in its own process group; return its exit, log tail and per-rank
    records. A job past LAUNCH_TIMEOUT is killed (its whole group) and reported as hung; shortly
    before that every rank writes all its threads' stacks to the log (fwcommon arms faulthandler)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(FW)]), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", **{fwcommon.DUMP_AFTER_ENV: str(LAUNCH_TIMEOUT - 15)})
    with open(out / "log.txt", "wb") as log:
        p = subprocess.Popen(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: int | str = p.wait(LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = f"hung (killed after {LAUNCH_TIMEOUT} s)"
        try:  # this job's group only: a rank left behind by a crashed peer must not outlive it
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    ranks = []
    for r in (0, 1):
        f = out / "records" / f"rank{r}.json"
        ranks.append(json.loads(f.read_text())["runs"] if f.exists() else {})
    tail = (out / "log.txt").read_text(errors="replace")[-3000:]
    return {"rc": rc, "log": tail, "ranks": ranks, "cmd": " ".join(cmd)}


def _launch(cmd: list[str], out: Path, kind: str) -> dict:
    """:func:`_launch_once`; torch's reference job is launched once more if it hung. On CPython
    3.11 releases without the fix of gh-112275 (3.11.7, this project's interpreter, among them) a
    worker forked while another thread of the parent holds the interpreter's thread-list lock
    deadlocks before it runs any Python; torch's DataLoader forks its workers afresh every epoch
    of a DDP rank, and the job then waits for ever (rank 0 for a worker stuck in
    ``PyOS_AfterFork_Child``, rank 1 in the all-reduce). That is the interpreter's fault, not the
    behaviour the reference stands for, so a hung reference is run again (its first log kept
    beside it). feedgpu's job gets no second launch: a hang there fails the test."""
    job = _launch_once(cmd, out)
    if kind == "torch" and str(job["rc"]).startswith("hung"):
        out.rename(out.with_name(out.name + "-hung"))
        first = job["rc"]
        job = _launch_once(cmd, out)
        job["rc"] = f"{job['rc']}; the first launch {first} (its log: {out.name}-hung/log.txt)"
    return job


def lightning(workdir: Path, kind: str, scenario: str) -> dict:
    key = ("lightning", kind, scenario)
    if key not in _launched:
        if scenario == "resume":
            lightning(workdir, kind, "fit")  # writes the checkpoints
        out = workdir / f"lightning_{kind}_{scenario}"
        _launched[key] = _launch([sys.executable, str(FW / "lightning_run.py"), kind, scenario, str(out / "records"),
                                  str(workdir / "images"), str(workdir / f"ckpt_{kind}")], out, kind)
    return _launched[key]


def accelerate(workdir: Path, kind: str, scenario: str) -> dict:
    key = ("accelerate", kind, scenario)
    if key not in _launched:
        if scenario == "resume":
            accelerate(workdir, kind, "train")  # writes the state
        out = workdir / f"accelerate_{kind}_{scenario}"
        _launched[key] = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                  "--standalone", str(FW / "accelerate_run.py"), kind, scenario,
                                  str(out / "records"), str(workdir / "images"), str(workdir / f"state_{kind}")], out, kind)
    return _launched[key]


def run(job: dict, name: str) -> list[list]:
    """Per rank, the batches ``[epoch, batch_idx, indices, extra]`` of run ``name``; fails with
    each rank's error (last traceback lines) when a rank raised, hung or recorded nothing."""
    problems = []
    for r, runs in enumerate(job["ranks"]):
        rec = runs.get(name)
        if rec is None:
            problems.append(f"rank {r}: no record of {name!r}")
        elif "error" in rec:
            lines = [ln for ln in rec["error"].strip().splitlines() if ln.strip()]
            problems.append(f"rank {r} raised: " + " | ".join(lines[-3:]))
    if problems:
        pytest.fail(f"{name}: " + "; ".join(problems) + f" (exit {job['rc']}; {job['cmd']})\nlog tail:\n{job['log'][-1500:]}",
                    pytrace=False)
    return [runs[name]["batches"] for runs in job["ranks"]]


def info(job: dict, name: str, key: str):
    return [runs.get(name, {}).get(key) for runs in job["ranks"]]


# -- what is asserted ---------------------------------------------------------------------------
def epoch_samples(batches: list, epoch: int) -> list[int]:
    return [i for b in batches if b[0] == epoch for i in b[2]]


def assert_shards(per_rank: list[list], n: int, delivered: int, where: str) -> None:
    """Each epoch: ranks get as many batches; together every sample, the documented padding
    (``delivered - n`` repeats) and nothing else; the order changes between epochs."""
    for epoch in range(EPOCHS):
        counts = [sum(1 for b in rk if b[0] == epoch) for rk in per_rank]
        assert len(set(counts)) == 1 and counts[0] > 0, f"{where}: epoch {epoch}: batches per rank {counts}"
        shards = [epoch_samples(rk, epoch) for rk in per_rank]
        seen = [i for s in shards for i in s]
        repeated = {i: c for i, c in Counter(seen).items() if c > 1}
        assert set(seen) == set(range(n)), f"{where}: epoch {epoch}: missing {sorted(set(range(n)) - set(seen))}"
        assert len(seen) == delivered, (
            f"{where}: epoch {epoch}: {len(seen)} samples delivered over the ranks, expected {delivered} "
            f"({n} + {delivered - n} padding); repeated: {repeated}; "
            f"ranks overlap in {len(set(shards[0]) & set(shards[1]))} samples")
    for r, rk in enumerate(per_rank):
        assert epoch_samples(rk, 0) != epoch_samples(rk, 1), f"{where}: rank {r} got the same order in both epochs"


def assert_resumed(full: list[list], resumed: list[list], where: str) -> None:
    """Per rank: the uninterrupted run's batches before the checkpoint, then the resumed run's,
    are the uninterrupted run's batches (same batch numbers, same samples)."""
    for r, (f, g) in enumerate(zip(full, resumed)):
        before = [b[:3] for b in f if (b[0], b[1]) < (0, RESUMED_AFTER)]
        after = [b[:3] for b in g]
        expected = [b[:3] for b in f]
        if before + after != expected:
            first = next((k for k, (x, y) in enumerate(zip(before + after, expected)) if x != y),
                         min(len(before + after), len(expected)))
            pytest.fail(f"{where}: rank {r}: resumed run differs from the uninterrupted one at batch {first}: "
                        f"got {(before + after)[first:first + 3]}, expected {expected[first:first + 3]} "
                        f"({len(after)} batches after the resume, {len(expected) - len(before)} expected)",
                        pytrace=False)


# -- Lightning ------------------------------------------------------------------------------------
@cases("lightning_shards", "kind,data,built", DATA_BUILT)
def test_lightning_ranks_disjoint_and_complete(workdir, kind, data, built):
    job = lightning(workdir, kind, "fit")
    name = f"{built}_{data}"
    assert_shards(run(job, name), *(LIGHTNING_DATASET if data == "dataset" else LIGHTNING_PIPELINE),
                  f"lightning {kind} {name} (loader {info(job, name, 'loader')[0]}, sampler {info(job, name, 'sampler')})")


@cases("lightning_resume", "kind,data,built", RESUMED)
def test_lightning_mid_epoch_checkpoint_resumes_exactly_on_2_ranks(workdir, kind, data, built):
    saved = "before_dataset_resumable" if kind == "torch" and built == "before" else f"{built}_{data}"
    full = run(lightning(workdir, kind, "fit"), saved)
    resumed_job = lightning(workdir, kind, "resume")
    name = "resume_" + built + ("_pipeline" if data == "pipeline" else "")
    resumed = run(resumed_job, name)
    where = f"lightning {kind} {name}"
    assert not any(info(resumed_job, name, "warnings")), \
        f"{where}: Lightning found the loader not resumable: {info(resumed_job, name, 'warnings')}"
    assert_resumed(full, resumed, where)
    # nothing repeated or lost over the ranks, before and after the checkpoint together
    assert_shards(full, *(LIGHTNING_DATASET if data == "dataset" else LIGHTNING_PIPELINE),
                  f"{where} (the uninterrupted run)")


def test_lightning_plain_torch_loader_restarts_an_interrupted_epoch(workdir):
    """Reference for the README: torch's own DataLoader has no state, so after a mid-epoch
    checkpoint Lightning warns and the epoch's first batches come again (the harness sees it)."""
    full = run(lightning(workdir, "torch", "fit"), "before_dataset")
    job = lightning(workdir, "torch", "resume")
    resumed = run(job, "resume_plain")
    assert any("not resumable" in w for w in info(job, "resume_plain", "warnings")[0])
    for f, g in zip(full, resumed):
        assert [b[2] for b in g[:RESUMED_AFTER]] == [b[2] for b in f[:RESUMED_AFTER]]  # epoch 0 again from its start
        assert [b[:3] for b in f[:RESUMED_AFTER]] + [b[:3] for b in g] != [b[:3] for b in f]


def assert_distinct_draws(per_rank: list[list], where: str) -> None:
    """Lightning's worker seeding gives every worker of every rank its own NumPy stream."""
    for epoch in range(EPOCHS):
        drawn = [d for rk in per_rank for b in rk if b[0] == epoch for d in b[3]]
        across = len(set(epoch_samples_draws(per_rank[0], epoch)) & set(epoch_samples_draws(per_rank[1], epoch)))
        repeats = len(drawn) - len(set(drawn))
        assert repeats == 0, f"{where}: epoch {epoch}: {repeats} of {len(drawn)} NumPy draws in the workers repeated " \
                             f"({across} shared by rank 0 and rank 1): their RNG streams were not seeded apart"


def epoch_samples_draws(batches: list, epoch: int) -> list[int]:
    return [d for b in batches if b[0] == epoch for d in b[3]]


@cases("lightning_workers", "kind,seed", [(k, s) for k in KINDS for s in (42, 0)])
def test_lightning_seed_everything_workers_with_2_workers(workdir, kind, seed):
    job = lightning(workdir, kind, "workers")
    where = f"lightning {kind} seed_everything({seed}, workers=True)"
    if seed == 42:
        assert_shards(run(job, "workers_pipeline"), *LIGHTNING_PIPELINE, f"{where} workers_pipeline")
    per_rank = run(job, "workers_dataset" if seed == 42 else "workers_seed0")
    assert_shards(per_rank, *LIGHTNING_DATASET, where)
    assert_distinct_draws(per_rank, where)


# -- accelerate -----------------------------------------------------------------------------------
@cases("accelerate_shards", "kind,data", [(k, d) for k in KINDS for d in ("dataset", "pipeline")])
def test_accelerate_prepare_ranks_disjoint_and_complete(workdir, kind, data):
    job = accelerate(workdir, kind, "train")
    expected = ACCELERATE_DATASET[kind] if data == "dataset" else ACCELERATE_PIPELINE
    assert_shards(run(job, data), *expected, f"accelerate {kind} {data} (prepare() returned {info(job, data, 'loader')[0]})")


@cases("accelerate_sync", "kind", [(k,) for k in KINDS])
def test_accelerate_last_batch_of_an_epoch_is_a_sync_step(workdir, kind):
    job = accelerate(workdir, kind, "train")
    for r, rk in enumerate(run(job, "dataset")):
        for epoch in range(EPOCHS):
            flags = [b[3] for b in rk if b[0] == epoch]
            assert len(flags) % 2 == 1, f"rank {r}: epoch {epoch}: {len(flags)} batches, an odd number was set up"
            expected = [(i + 1) % 2 == 0 or i == len(flags) - 1 for i in range(len(flags))]
            assert flags == expected, f"accelerate {kind}: rank {r}: epoch {epoch}: sync_gradients {flags}, " \
                                      f"expected {expected} (prepare() returned {info(job, 'dataset', 'loader')[r]})"


@cases("accelerate_resume", "kind", [(k,) for k in KINDS])
def test_accelerate_mid_epoch_save_state_resumes_exactly_on_2_ranks(workdir, kind):
    full = run(accelerate(workdir, kind, "train"), "dataset")
    resumed = run(accelerate(workdir, kind, "resume"), "resume")
    assert_resumed(full, resumed, f"accelerate {kind}")
    assert_shards(full, *ACCELERATE_DATASET[kind], f"accelerate {kind} (the uninterrupted run)")
    for r, (f, g) in enumerate(zip(full, resumed)):   # accumulation goes on where it stopped
        assert [b[3] for b in g] == [b[3] for b in f][RESUMED_AFTER:], \
            f"accelerate {kind}: rank {r}: sync_gradients after the resume {[b[3] for b in g]}, " \
            f"uninterrupted {[b[3] for b in f][RESUMED_AFTER:]}"


def test_accelerate_runs_feedgpus_loader_with_its_pool(workdir):
    """``prepare(model, optimizer, loader)`` after ``prepare_data_loader``: what it hands back is
    feedgpu's ``AcceleratedLoader`` around the feedgpu loader, whose 2 workers ran and whose
    stats count every batch and sample the rank trained on (5 batches, 9 samples per epoch)."""
    job = accelerate(workdir, "feedgpu", "train")
    for name, per_epoch in (("dataset", 9), ("pipeline", N_IMAGES // 2)):
        per_rank = run(job, name)
        for r, (got, rk) in enumerate(zip(info(job, name, "loader"), per_rank)):
            where = f"accelerate feedgpu {name}: rank {r}"
            assert got["type"] == "feedgpu.integrations.accelerate.AcceleratedLoader", f"{where}: prepare() returned {got}"
            assert got["inner"] == "feedgpu.loader.front.DataLoader", f"{where}: {got}"
            assert info(job, name, "workers")[r] == 2, f"{where}: feedgpu's pool ran {info(job, name, 'workers')[r]} workers"
            stats = info(job, name, "stats")[r]
            assert stats == {"batches": EPOCHS * ACCELERATE_BATCHES, "samples": EPOCHS * per_epoch} \
                   == {"batches": len(rk), "samples": sum(len(b[2]) for b in rk)}, f"{where}: stats {stats}"


def test_accelerate_sync_flags_of_feedgpus_loader_are_torchs(workdir):
    torch_runs = run(accelerate(workdir, "torch", "train"), "dataset")
    feedgpu_runs = run(accelerate(workdir, "feedgpu", "train"), "dataset")
    for r, (t, f) in enumerate(zip(torch_runs, feedgpu_runs)):
        for epoch in range(EPOCHS):
            tf = [b[3] for b in t if b[0] == epoch]
            ff = [b[3] for b in f if b[0] == epoch]
            assert len(ff) == ACCELERATE_BATCHES and ff == tf, f"rank {r}: epoch {epoch}: feedgpu {ff}, torch {tf}"


def test_accelerate_prepare_rebuilds_a_feedgpu_loader_given_alone(workdir):
    """The trade-off the docs state: without ``prepare_data_loader``, ``prepare()`` rebuilds
    feedgpu's loader as accelerate's ``DataLoaderShard`` around torch's ``DataLoader`` (feedgpu
    runs none of it: accelerate's sharding, its even_batches padding)."""
    job = accelerate(workdir, "feedgpu", "train")
    per_rank = run(job, "plain")
    got = info(job, "plain", "loader")[0]
    assert got["type"] == "accelerate.data_loader.DataLoaderShard" and got["inner"] == "torch.utils.data.dataloader.DataLoader", got
    assert_shards(per_rank, *ACCELERATE_DATASET["torch"], "accelerate feedgpu plain")
