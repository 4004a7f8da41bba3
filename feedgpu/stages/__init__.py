"""Pipeline stages: decode, augment, normalize, user callables."""
from .base import BatchStage, SampleStage, Stage, sample_rng
from .custom import PythonStage
from .decode import Decode
from .geometry import HorizontalFlip, RandomResizedCrop, Resize, ResizeCenterCrop, random_resized_crop_params
from .normalize import IMAGENET_MEAN, IMAGENET_STD, Normalize
from .registry import BUILTIN, stage_classes

__all__ = ["BUILTIN", "BatchStage", "Decode", "HorizontalFlip", "IMAGENET_MEAN", "IMAGENET_STD",
           "Normalize", "PythonStage", "RandomResizedCrop", "Resize", "ResizeCenterCrop", "SampleStage", "Stage",
           "random_resized_crop_params", "sample_rng", "stage_classes"]
