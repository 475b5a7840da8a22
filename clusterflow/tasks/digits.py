"""python -m clusterflow.tasks.digits OUT_DIR

Writes scikit-learn's copy of the UCI handwritten digits (1,797 real 8x8 scans, 17 grey levels,
no download) as an image folder: ``OUT_DIR/<digit>/<i>.png``, the layout ``ImageFolderTask``
reads (one sub-folder per class). ``i`` is the sample's position in ``load_digits()``.

The PNGs keep the scans' native 8x8 size: upscaling here would add no information (the task
resizes to its ``image_size`` on load), and the files then hold exactly the pixels the
k-means-on-pixels baseline of docs/examples.md clusters (grey level v is stored as
round(v * 255 / 16)).

The folder appears atomically: it is written under a temporary name and renamed, so several ranks
asked to create it at once (``task.params.make_digits``) never see a half-written folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys

import numpy as np
from PIL import Image

from clusterflow.errors import EXIT_OK, UserError, cli


def write_digits(out_dir: str) -> int:
    """Write the digits into ``out_dir`` (which must not exist or be empty). Returns how many
    images the folder holds; when another process created it first, its copy is kept."""
    # scikit-learn takes about a second to import: only the command that writes the digits does
    from sklearn.datasets import load_digits

    digits = load_digits()
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{os.path.abspath(out_dir)}.tmp-{socket.gethostname()}-{os.getpid()}"
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    for label in range(10):
        os.makedirs(os.path.join(tmp, str(label)), exist_ok=True)
    for i, (img, label) in enumerate(zip(pixels, digits.target)):
        Image.fromarray(img).save(os.path.join(tmp, str(label), f"{i:04d}.png"))
    try:
        os.rename(tmp, out_dir)  # replaces an empty folder; fails if a peer got there first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(out_dir):
            raise
    return len(pixels)


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.tasks.digits",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out_dir", help="folder to create, e.g. data/digits")
    args = p.parse_args(argv)
    if os.path.exists(args.out_dir) and (
        not os.path.isdir(args.out_dir) or os.listdir(args.out_dir)
    ):
        raise UserError(
            f"{args.out_dir} already exists and is not an empty folder; "
            "remove it or pick another OUT_DIR"
        )
    n = write_digits(args.out_dir)
    print(f"wrote {n} digit images (8x8 PNG, 10 class folders) to {args.out_dir}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
