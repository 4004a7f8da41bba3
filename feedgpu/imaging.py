"""Which PIL build is active: Pillow-SIMD or stock Pillow, and whether it was built with AVX2.

Pillow-SIMD and Pillow both install the ``PIL`` package; installing anything that requires
``pillow`` silently replaces Pillow-SIMD, losing its faster resize (``bench/results/cpu_loader.md``
compares the builds). feedgpu reports the active build in ``feedgpu doctor``, ``explain`` and
bench output.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def pil_build() -> dict:
    """``{"version", "simd", "avx2", "libjpeg_turbo", "webp"}``; ``avx2`` is None when unknown.

    Pillow-SIMD versions end in ``.postN``; AVX2 is read from the compiler flags recorded in the
    ``_imaging`` extension (``-mavx2``), present when it was built with debug info (the default).
    """
    import PIL
    from PIL import _imaging, features

    version = PIL.__version__
    avx2 = None
    simd = ".post" in version
    try:
        with open(_imaging.__file__, "rb") as f:
            blob = f.read()
        simd = simd or b"ImagingSIMD" in blob
        if b"-mavx2" in blob:
            avx2 = True
        elif b"GNU C" in blob:
            avx2 = False
    except OSError:
        pass
    return {"version": version, "simd": simd, "avx2": avx2,
            "libjpeg_turbo": bool(features.check_feature("libjpeg_turbo")), "webp": bool(features.check("webp"))}


def pil_label() -> str:
    b = pil_build()
    name = "Pillow-SIMD" if b["simd"] else "Pillow"
    flags = {True: ", AVX2", False: ", no AVX2", None: ""}[b["avx2"]]
    return f"{name} {b['version']}{flags}"
