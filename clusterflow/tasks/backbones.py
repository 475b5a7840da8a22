"""Convolutional encoders for the image task, written in plain torch (no torchvision).

``small``: four 3x3 conv stages, cheap enough to train on a laptop CPU. ``resnet18``: the
ResNet-18 layout (2-2-2-2 basic blocks, widths 64-512 at ``width=64``) for GPUs, with the
ImageNet stem (7x7 stride 2 + max-pool) for images of 96 px and more and the CIFAR stem (one 3x3
conv, no pooling) below, where the ImageNet stem would throw away most of the pixels.

GroupNorm instead of BatchNorm everywhere: batch statistics differ per rank, which would make a
2-rank run train differently from a 1-rank run on the same global batch.
"""

from __future__ import annotations

import torch
from torch import nn

BACKBONES = ("small", "resnet18")


def norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels // 4) or 1, channels)


def conv_block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), norm(cout), nn.ReLU(inplace=True)
    )


def small_net(channels: int, width: int) -> tuple[nn.Module, int]:
    w = width
    net = nn.Sequential(
        conv_block(channels, w),
        conv_block(w, 2 * w, 2),
        conv_block(2 * w, 2 * w),
        conv_block(2 * w, 4 * w, 2),
        conv_block(4 * w, 4 * w),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    return net, 4 * w


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            norm(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            norm(cout),
        )
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet18(channels: int, width: int, image_size: int) -> tuple[nn.Module, int]:
    if image_size >= 96:
        stem = nn.Sequential(
            nn.Conv2d(channels, width, 7, 2, 3, bias=False),
            norm(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
    else:
        stem = conv_block(channels, width)
    layers: list[nn.Module] = [stem]
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        stride = 1 if stage == 0 else 2
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers), cin


class Encoder(nn.Module):
    """Backbone -> MLP projection -> L2-normalised embedding (what the loss and mining both use)."""

    def __init__(
        self, backbone: str, channels: int, image_size: int, width: int, embed_dim: int
    ) -> None:
        super().__init__()
        if backbone == "small":
            self.backbone, feat = small_net(channels, width)
        else:
            self.backbone, feat = resnet18(channels, width, image_size)
        self.head = nn.Sequential(
            nn.Linear(feat, feat), nn.ReLU(inplace=True), nn.Linear(feat, embed_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.head(self.backbone(x)), dim=-1)
