"""A mining round's threshold curve as an image for TensorBoard, drawn with Pillow.

matplotlib is not a dependency (and TensorBoard's ``add_figure`` needs it); ``add_image`` takes an
(H, W, 3) uint8 array, which Pillow (a dependency) draws in a few milliseconds. Scalars per
threshold would not do: TensorBoard's x axis is the training step, not the threshold.

Top panel: clusters, singletons and the largest cluster per threshold (log scale). Bottom panel:
modularity, and NMI and ARI when the task has ground truth (0 to 1). A vertical line marks the
threshold the round used (its value and rule above it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

WIDTH, HEIGHT, LEFT, RIGHT, TOP, GAP, BOTTOM = 760, 500, 60, 150, 30, 40, 36
COUNTS = (
    ("num_clusters", "clusters", (31, 119, 180)),
    ("num_singletons", "singletons", (44, 160, 44)),
    ("largest_cluster", "largest cluster", (214, 39, 40)),
)
SCORES = (
    ("modularity", "modularity", (148, 103, 189)),
    ("nmi", "NMI", (255, 127, 14)),
    ("ari", "ARI", (140, 86, 75)),
)


def render(stats: dict[str, Any]) -> np.ndarray:
    """The figure of one round's stats (``curve``, ``threshold``, ``threshold_rule``, ``epoch``)."""
    curve = stats["curve"]
    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(img)
    t = np.asarray(curve["thresholds"], np.float64)
    lo, hi = float(t.min()), float(t.max())
    span = hi - lo or 1.0
    panel = (HEIGHT - TOP - GAP - BOTTOM) // 2
    boxes = [(TOP, TOP + panel), (TOP + panel + GAP, TOP + 2 * panel + GAP)]

    def x_of(value: float) -> float:
        return LEFT + (value - lo) / span * (WIDTH - LEFT - RIGHT)

    n = max(max(curve["num_clusters"]), max(curve["largest_cluster"]), 2)
    top_of = math.log10(n) or 1.0
    counts = {
        key: [
            (x_of(a), _y(math.log10(max(b, 1)) / top_of, boxes[0])) for a, b in zip(t, curve[key])
        ]
        for key, _, _ in COUNTS
    }
    scores = {
        key: [(x_of(a), _y(min(max(b, 0.0), 1.0), boxes[1])) for a, b in zip(t, curve[key])]
        for key, _, _ in SCORES
        if curve.get(key) is not None
    }
    for (y0, y1), series, labels in ((boxes[0], counts, COUNTS), (boxes[1], scores, SCORES)):
        draw.rectangle((LEFT, y0, WIDTH - RIGHT, y1), outline="black")
        for i, (key, name, colour) in enumerate(item for item in labels if item[0] in series):
            draw.line(series[key], fill=colour, width=2)
            draw.text((WIDTH - RIGHT + 10, y0 + 4 + 16 * i), name, fill=colour)
    for i in range(int(math.log10(n)) + 1):
        draw.text((6, _y(i / top_of, boxes[0]) - 6), f"{10**i:,}", fill="black")
    for v in (0.0, 0.5, 1.0):
        draw.text((6, _y(v, boxes[1]) - 6), f"{v:.1f}", fill="black")
    for tick in _ticks(lo, hi):
        draw.line((x_of(tick), boxes[1][1], x_of(tick), boxes[1][1] + 4), fill="black")
        draw.text((x_of(tick) - 12, boxes[1][1] + 6), f"{tick:.2f}", fill="black")
    draw.text(
        (LEFT, HEIGHT - 14), "threshold (cosine similarity of a kept mutual edge)", fill="black"
    )
    chosen = stats.get("threshold")
    title = f"mining after epoch {stats.get('epoch')}: " + (
        f"threshold {chosen:.4g} ({stats.get('threshold_rule', 'fixed')})"
        if chosen is not None
        else f"method {stats.get('method')}"
    )
    draw.text((LEFT, 8), title, fill="black")
    if chosen is not None and lo <= chosen <= hi:
        draw.line((x_of(chosen), boxes[0][0], x_of(chosen), boxes[1][1]), fill=(0, 0, 0), width=1)
    return np.asarray(img)


def _y(fraction: float, box: tuple[int, int]) -> float:
    return box[1] - fraction * (box[1] - box[0])


def _ticks(lo: float, hi: float) -> list[float]:
    step = next(s for s in (0.05, 0.1, 0.2, 0.25, 0.5, 1.0) if (hi - lo) / s <= 8)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 6) for i in range(int((hi - first) / step + 1e-9) + 1)]
