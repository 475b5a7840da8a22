"""Image augmentations that depend only on (seed, epoch, index, view).

Every random draw of a view comes from a ``torch.Generator`` seeded by a hash of those four
numbers, never from a global or per-rank stream, so a sample looks the same whichever rank or
DataLoader worker decodes it: 1 and N processes train on bitwise the same pixels.

One view is a single affine warp (random resized crop, optional horizontal flip, small rotation)
done with ``affine_grid``/``grid_sample`` on the decoded tensor, then brightness and contrast
jitter. Pure torch: torchvision's PyPI wheel does not import against every torch build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def view_seed(seed: int, epoch: int, index: int, view: int) -> int:
    """A well-mixed 63-bit seed for one view (SeedSequence hashes the tuple; nearby tuples do not
    give correlated streams, unlike seed + index arithmetic)."""
    state = np.random.SeedSequence([seed, 0x1A6E, epoch, index, view]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def view_generator(seed: int, epoch: int, index: int, view: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(view_seed(seed, epoch, index, view))
    return g


def sampling_grid(theta: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``F.affine_grid(theta[None], (1, C, h, w), align_corners=False)`` from element-wise ops:
    affine_grid's batched matmul starts the intra-op thread pool for a few hundred numbers, which
    made one view 30x slower with 2 threads on a busy machine."""
    ys = (torch.arange(h, dtype=torch.float32) * 2 + 1) / h - 1
    xs = (torch.arange(w, dtype=torch.float32) * 2 + 1) / w - 1
    y, x = ys[:, None], xs[None, :]
    gx = theta[0, 0] * x + theta[0, 1] * y + theta[0, 2]
    gy = theta[1, 0] * x + theta[1, 1] * y + theta[1, 2]
    return torch.stack([gx, gy], dim=-1)[None]


@dataclass(frozen=True)
class Augment:
    """Parameters of one augmented view.

    ``crop_scale``: the crop keeps between this fraction and all of the image's area (aspect ratio
    between 3/4 and 4/3); ``flip``: mirror left-right half of the time (off for digits and text);
    ``rotate_deg``: rotation drawn from [-rotate_deg, rotate_deg]; ``jitter``: brightness and
    contrast factors drawn from [1 - jitter, 1 + jitter].
    """

    crop_scale: float = 0.5
    flip: bool = True
    rotate_deg: float = 10.0
    jitter: float = 0.3

    def theta(self, g: torch.Generator) -> torch.Tensor:
        """The (2, 3) affine map from output to input coordinates ([-1, 1] on both axes)."""
        u = torch.rand(
            5, generator=g, dtype=torch.float64
        ).tolist()  # always 5 draws: the stream never shifts
        area = self.crop_scale + (1.0 - self.crop_scale) * u[0]
        # Aspect ratios in [3/4, 4/3] that fit inside the image at this area (exactly 1 at area 1).
        lo, hi = max(math.log(3 / 4), math.log(area)), min(math.log(4 / 3), -math.log(area))
        ratio = math.exp(lo + (hi - lo) * u[1])
        w, h = math.sqrt(area * ratio), math.sqrt(area / ratio)
        cx = (1.0 - w) * (2 * u[2] - 1)  # the crop stays inside the image
        cy = (1.0 - h) * (2 * u[3] - 1)
        angle = math.radians(self.rotate_deg * (2 * u[4] - 1))
        cos, sin = math.cos(angle), math.sin(angle)
        # input = centre + R(angle) @ diag(w, h) @ output: crop, then rotate about the crop's centre
        return torch.tensor([[cos * w, -sin * h, cx], [sin * w, cos * h, cy]], dtype=torch.float32)

    def __call__(self, img: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """``img``: (C, H, W) float in [0, 1]. Returns a view of the same shape, in [0, 1]."""
        theta = self.theta(g)
        u = torch.rand(3, generator=g, dtype=torch.float64).tolist()
        if self.flip and u[0] < 0.5:
            theta[:, 0] = -theta[:, 0]  # mirror the output's x axis
        grid = sampling_grid(theta, img.shape[1], img.shape[2])
        out = F.grid_sample(
            img[None], grid, mode="bilinear", padding_mode="zeros", align_corners=False
        )[0]
        brightness = 1.0 + self.jitter * (2 * u[1] - 1)
        contrast = 1.0 + self.jitter * (2 * u[2] - 1)
        out = out * brightness
        mean = out.mean()
        return (mean + (out - mean) * contrast).clamp_(0.0, 1.0)
