"""torchvision datasets and transforms compiled into feedgpu's stages (an optional part:
``pip install feedgpu[torchvision]``).

:class:`feedgpu.DataLoader` takes an ``ImageFolder`` / ``DatasetFolder`` (with torchvision's
default loader, also inside ``Subset``) whose ``transform`` is a v1 or v2 ``Compose`` or one
transform, and compiles the transforms it recognises (:mod:`~feedgpu.torchvision.compile`).
Importing this package does not import torchvision: a dataset can only be a torchvision one when
the user imported torchvision already.
"""
from .backend import TorchvisionBackend, backend_for
from .compile import Compiled, compile_transform
from .dali import dali_pipeline
from .pipeline_out import pipeline_config, pipeline_yaml
from .recognise import recognise

__all__ = ["Compiled", "TorchvisionBackend", "backend_for", "compile_transform", "dali_pipeline", "pipeline_config",
           "pipeline_yaml", "recognise"]
