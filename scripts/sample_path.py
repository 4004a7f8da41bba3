"""Which of feedgpu's files one batch crosses, and how often the call climbs back up into the loader.

Traces (``sys.setprofile``, Python calls only) the packaged ``imagenet_train.yaml`` (``decode ->
random_resized_crop -> horizontal_flip -> normalize``) over a folder of JPEGs, from ``feedgpu.DataLoader(p)`` to the
first batch in the training loop, in one process (``num_workers=0``: the worker's code runs
inline, so the sample's steps are traced too). Prints:

- the files of ``feedgpu/`` whose functions ran, in the order first entered (what imports run,
  module and class bodies and calls they make, left out);
- the climbs: distinct calls from a module outside the loader's rooms into one of them (the
  loader's rooms: ``feedgpu/loader/`` or, in checkouts from before it, ``loader*.py`` and
  ``epoch.py`` at the package root) made while the loader's own code was below on the stack —
  a lower floor calling back up into the loader that called it.

Run from a checkout (its ``feedgpu`` first on the path) to compare two commits the same way:

    PYTHONPATH=$PWD .venv/bin/python scripts/sample_path.py [--images 32]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def loader_room(rel: str) -> bool:
    name = rel.split("/")
    return (len(name) > 1 and name[0] == "loader") or (len(name) == 1 and (name[0].startswith("loader")
                                                                           or name[0] == "epoch.py"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=32)
    args = ap.parse_args(argv)
    import feedgpu
    from feedgpu import Pipeline
    from feedgpu.sample_data import build_imagenet_like

    pkg = Path(feedgpu.__file__).resolve().parent
    with tempfile.TemporaryDirectory() as tmp:
        data = build_imagenet_like(Path(tmp) / "data", args.images)
        p = Pipeline.from_yaml(pkg / "pipelines" / "imagenet_train.yaml",
                               **{"source.path": str(data), "loader.batch_size": 8, "loader.num_workers": 0})
        order: list[str] = []
        first: dict[str, str] = {}   # file -> the first function entered in it
        climbs: set[tuple[str, str]] = set()
        stack: list[tuple[str | None, bool]] = []   # (file under feedgpu/, inside an import)

        def prof(frame, event, arg):
            if event == "call":
                code = frame.f_code
                try:
                    rel = str(Path(code.co_filename).resolve().relative_to(pkg))
                except ValueError:
                    rel = None
                importing = code.co_name == "<module>" or (bool(stack) and stack[-1][1])
                if rel is not None and not importing:   # calls, not what imports run (module and class bodies)
                    if rel not in order:
                        order.append(rel)
                        first[rel] = code.co_name
                    mine = [c for c, _ in stack if c is not None]
                    if loader_room(rel) and mine and not loader_room(mine[-1]) and any(map(loader_room, mine)):
                        climbs.add((mine[-1], f"{rel}:{code.co_name}"))
                stack.append((rel, importing))
            elif event == "return" and stack:
                stack.pop()

        sys.setprofile(prof)
        try:
            loader = feedgpu.DataLoader(p)
            next(iter(loader))
        finally:
            sys.setprofile(None)
    print(f"{len(order)} files of feedgpu/ on the path of one batch:")
    for f in order:
        print(f"  {f:<28} {first[f]}")
    print(f"{len(climbs)} climbs back up into the loader:")
    for a, b in sorted(climbs):
        print(f"  {a} -> {b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
