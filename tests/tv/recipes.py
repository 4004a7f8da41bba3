"""The transforms users write: torchvision's ImageNet reference recipes (v1 and v2), a uint8
recipe and one with a transform feedgpu does not compile."""
from __future__ import annotations

import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as T2

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def v1_train(size=224):
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])


def v1_val():
    return T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])


def v2_train(size=224):
    return T2.Compose([T2.RandomResizedCrop(size, antialias=True), T2.RandomHorizontalFlip(), T2.PILToTensor(),
                       T2.ToDtype(torch.float, scale=True), T2.Normalize(MEAN, STD), T2.ToPureTensor()])


def v2_val():
    return T2.Compose([T2.Resize(256, antialias=True), T2.CenterCrop(224), T2.PILToTensor(),
                       T2.ToDtype(torch.float, scale=True), T2.Normalize(MEAN, STD), T2.ToPureTensor()])


def uint8_train(size=224):
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()])


def jitter_train(size=224):
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ColorJitter(0.4, 0.4, 0.4),
                      T.ToTensor(), T.Normalize(MEAN, STD)])


def to_unit(x: torch.Tensor, normalized: bool) -> torch.Tensor:
    """A batch on the 0-1 scale of pixel values: uint8 / 255, or Normalize undone."""
    if x.dtype == torch.uint8:
        return x.double() / 255
    x = x.double()
    if normalized:
        x = x * torch.tensor(STD, dtype=torch.float64)[:, None, None] + torch.tensor(MEAN, dtype=torch.float64)[:, None, None]
    return x
