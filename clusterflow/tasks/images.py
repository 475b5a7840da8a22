"""Pseudo-ID contrastive learning on a folder of real images.

``task.target: clusterflow.tasks.images:ImageFolderTask`` with ``task.params.root: <folder>``.
The folder holds image files (PNG, JPEG, BMP, WebP, TIFF, GIF; any size, grey or colour) either
directly (a flat folder: no ground truth) or in one sub-folder per class (``root/<class>/...``,
nested folders allowed); class names are used only for the mining quality metrics
(``ground_truth()``), never for training.

The dataset holds file names, not pixels: each item is decoded with Pillow in ``__getitem__``, so
in the DataLoader's worker processes when ``data.num_workers > 0``. An image is centre-cropped to
a square and resized to ``image_size``; a training item holds two augmented views whose draws
depend only on (run.seed, epoch, index, view) (see ``augment.py``), so 1 and N ranks see the same
pixels. Training is the demo's: before the first mining round every image is its own identity
(two views of it are the positives), afterwards the mined pseudo-IDs are.

``python -m clusterflow.tasks.digits DIR`` writes real data to try it on (scikit-learn's UCI
digits, no download); ``make_digits: true`` makes the task write them itself when ``root`` is
missing or empty.

``task.target: clusterflow.tasks.images:ImageShardsTask`` trains the same way on the same images
packed into WebDataset-style tar shards (``python -m clusterflow.tasks.shards SRC_FOLDER OUT``,
``shard_format.py``): ``task.params.root`` is the shard folder, on any fsspec URL, and each item
is read by the shard index (docs/data.md).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps
from torch import nn
from torch.utils.data import Dataset

from clusterflow.errors import UserError
from clusterflow.tasks import DatasetError, OneOf, Range, Task, check_stop, shard_format
from clusterflow.tasks.augment import Augment, view_generator
from clusterflow.tasks.backbones import BACKBONES, Encoder
from clusterflow.tasks.digits import write_digits
from clusterflow.tasks.losses import supcon_loss

log = logging.getLogger("clusterflow.tasks.images")

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif")
ROOT = "task.params.root"  # what names an image folder in messages, unless a caller says


class UnreadableImage(DatasetError):
    """A file that Pillow cannot decode (one line, also from a DataLoader worker)."""


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


class _Walk:
    """One scan of ``root``: every folder is entered once, known by (device, inode), so a
    symlinked folder that leads back to one already scanned (``a/loop -> ..``) is skipped and
    remembered instead of multiplying the data; the stop flag and the time limit are checked at
    each folder."""

    def __init__(
        self, root: str, limit_s: float, clock: Callable[[], float], key: str = ROOT
    ) -> None:
        self.root, self.limit_s, self.clock, self.key = root, limit_s, clock, key
        self.started = clock()
        self.seen: set[tuple[int, int]] = set()
        self.skipped: list[str] = []  # links to folders already scanned, relative to root
        self.folders = self.images = 0

    def first_visit(self, path: str) -> bool:
        """Whether the folder at ``path`` is new to this scan (it is then marked as seen)."""
        try:
            st = os.stat(path)
        except OSError:
            return False  # vanished or unreadable: os.walk leaves such a folder out too
        key = (st.st_dev, st.st_ino)
        if key in self.seen:
            self.skipped.append(os.path.relpath(path, self.root))
            return False
        self.seen.add(key)
        return True

    def tick(self) -> None:
        """Before each folder is listed: stop when the job was asked to, fail past the limit."""
        check_stop(f"scanning {self.key}={self.root}")
        self.folders += 1
        if self.limit_s and self.clock() - self.started > self.limit_s:
            raise UserError(
                f"scanning {self.key}={self.root!r} took longer than "
                f"task.params.scan_limit_s={self.limit_s:g} seconds ({self.folders} folders, "
                f"{self.images} images so far); point root at a smaller folder, or raise "
                "task.params.scan_limit_s (0: no limit) for a folder this large"
            )

    def report(self) -> None:
        if self.skipped:
            log.warning(
                "%s=%s: %d linked folder(s) lead to a folder already scanned and "
                "were skipped (each folder is read once): %s",
                self.key,
                self.root,
                len(self.skipped),
                ", ".join(
                    f"{p} -> {os.path.realpath(os.path.join(self.root, p))}"
                    for p in self.skipped[:10]
                )
                + (", ..." if len(self.skipped) > 10 else ""),
            )


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows symlinks
    except OSError:
        return False


def _images_under(folder: str, walk: _Walk) -> list[str]:
    """The image files under ``folder``, in os.walk's top-down order (a folder's files, then each
    sub-folder's, by name), following symlinks to folders not scanned yet."""
    found: list[str] = []
    pending = [folder]
    while pending:
        here = pending.pop()
        walk.tick()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:
            continue  # an unreadable folder is left out, as os.walk does
        dirs = [e.path for e in entries if not e.name.startswith(".") and _is_dir(e)]
        files = [e.path for e in entries if _is_image(e.name) and not _is_dir(e)]
        found += files
        walk.images += len(files)
        pending += reversed([d for d in dirs if walk.first_visit(d)])
    return found


def scan(
    root: str,
    limit_s: float = 600.0,
    clock: Callable[[], float] = time.monotonic,
    key: str = ROOT,
) -> tuple[list[str], np.ndarray | None, list[str]]:
    """(paths relative to root in a fixed order, class index per path or None, class names).
    ``limit_s``: the longest the scan may take (0: no limit); ``key``: what names ``root`` in
    messages (the task's parameter, or a command's argument such as ``SRC``)."""
    if not os.path.isdir(root):
        what = "is a file, not a folder" if os.path.exists(root) else "does not exist"
        digits = "(or set task.params.make_digits=true)" if key == ROOT else ""
        raise UserError(
            f"{key}={root!r} {what}; point it at a folder of images "
            "(one sub-folder per class, or flat), or for the digits example run "
            f"`python -m clusterflow.tasks.digits {root}` first {digits}".rstrip()
        )
    # scandir: the entry types come with the listing, no stat per file (a flat folder may hold
    # millions).
    entries = sorted(
        (e for e in os.scandir(root) if not e.name.startswith(".")), key=lambda e: e.name
    )
    if not entries:
        raise UserError(
            f"{key}={root!r} is an empty folder; "
            "put image files in it (one sub-folder per class, or flat)"
        )
    top = [e.name for e in entries if e.is_file() and _is_image(e.name)]
    walk = _Walk(root, limit_s, clock, key)
    walk.first_visit(root)
    # Every class folder is marked before any is walked: a link from one class into another is
    # skipped, never read as the first class's images.
    class_dirs = [e for e in entries if e.is_dir() and walk.first_visit(e.path)]
    classes = {e.name: _images_under(e.path, walk) for e in class_dirs}
    classes = {d: files for d, files in classes.items() if files}
    walk.report()
    if top and classes:
        raise UserError(
            f"{key}={root!r} holds both image files ({top[0]}, ...) "
            f"and class folders with images ({next(iter(classes))}/, ...); "
            "move every image into a class folder, or use a flat folder"
        )
    if top:
        return top, None, []
    if not classes:
        raise UserError(
            f"{key}={root!r} holds no image files "
            f"({len(entries)} entries, e.g. {entries[0].name!r}); "
            f"accepted extensions: {' '.join(IMAGE_EXTENSIONS)}"
        )
    paths, labels = [], []
    for c, files in enumerate(classes.values()):
        paths += [os.path.relpath(f, root) for f in files]
        labels += [c] * len(files)
    return paths, np.asarray(labels, dtype=np.int64), list(classes)


def decode(path: str, channels: int, data: bytes | None = None) -> torch.Tensor:
    """(channels, H, W) float32 in [0, 1], EXIF orientation applied; 16-bit grey keeps its range.
    ``data``: the file's bytes, already read (``path`` then only names it)."""
    try:
        with Image.open(path if data is None else io.BytesIO(data)) as img:
            img = ImageOps.exif_transpose(img)
            if img.mode in ("I", "F") or img.mode.startswith("I;16"):
                a = np.asarray(img, dtype=np.float32) / (1.0 if img.mode == "F" else 65535.0)
                a = np.clip(a, 0.0, 1.0)
            else:
                a = (
                    np.asarray(img.convert("L" if channels == 1 else "RGB"), dtype=np.float32)
                    / 255.0
                )
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        fix = (
            "remove or replace the file (every file with an image extension under "
            "task.params.root is used)"
            if data is None
            else "replace its source image and write the shards again"
        )
        raise UnreadableImage(
            f"cannot decode image {path} ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    x = torch.from_numpy(np.ascontiguousarray(a))
    x = x[None] if x.ndim == 2 else x.permute(2, 0, 1)
    return x.expand(channels, -1, -1).contiguous() if x.shape[0] != channels else x


def fit_square(x: torch.Tensor, size: int) -> torch.Tensor:
    """Centre-crop (C, H, W) to a square and resize it to ``size`` x ``size`` (antialiased when
    shrinking)."""
    _, h, w = x.shape
    s = min(h, w)
    top, left = (h - s) // 2, (w - s) // 2
    x = x[:, top : top + s, left : left + s]
    if s == size:
        return x.contiguous()
    return F.interpolate(
        x[None], size=(size, size), mode="bilinear", antialias=s > size, align_corners=False
    )[0]


class ImageItems(Dataset):
    """Items: ``{"x1", "x2", "index"}`` (two augmented views) or, with ``augment=None``,
    ``{"x", "index"}`` (the plain resized image, for mining); ``load(index)`` says where the
    image comes from."""

    def __init__(self, image_size: int, channels: int, augment: Augment | None, seed: int) -> None:
        self.image_size, self.channels, self.augment, self.seed = (
            image_size,
            channels,
            augment,
            seed,
        )
        self.epoch = 0

    def load(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def view(self, img: torch.Tensor, index: int, view: int) -> torch.Tensor:
        assert self.augment is not None
        return self.augment(img, view_generator(self.seed, self.epoch, index, view))

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.item(self.load(index), index)

    def item(self, img: torch.Tensor, index: int) -> dict[str, Any]:
        if self.augment is None:
            return {"x": (img - 0.5) / 0.5, "index": index}
        return {
            "x1": (self.view(img, index, 0) - 0.5) / 0.5,
            "x2": (self.view(img, index, 1) - 0.5) / 0.5,
            "index": index,
        }


class ImageFiles(ImageItems):
    """One file per image under ``root``."""

    def __init__(
        self,
        root: str,
        files: list[str],
        image_size: int,
        channels: int,
        augment: Augment | None,
        seed: int,
    ) -> None:
        super().__init__(image_size, channels, augment, seed)
        # One bytes array, not a list of str: forked DataLoader workers would touch every
        # object's refcount and copy the whole list into each worker (pytorch issue 13246).
        self.files = np.array([os.fsencode(f) for f in files])
        self.root = root

    def __len__(self) -> int:
        return len(self.files)

    def data_digest(self) -> str:
        """What the run's checkpoints record of the data (``Task`` protocol): the file list in
        index order, so images added, removed or renamed are other data."""
        h = hashlib.sha256(f"{len(self.files)}:{self.files.dtype.itemsize}:".encode())
        h.update(self.files.tobytes())
        return h.hexdigest()

    def path(self, index: int) -> str:
        return os.path.join(self.root, os.fsdecode(self.files[index]))

    def load(self, index: int) -> torch.Tensor:
        return fit_square(decode(self.path(index), self.channels), self.image_size)


class ShardImages(ImageItems):
    """The images of a shard folder, read by its index (``shard_format.py``): a batch is read at
    once (``__getitems__``, sorted by where its samples lie), and the epoch's order keeps shards
    together (``epoch_order``)."""

    def __init__(
        self,
        reader: shard_format.ShardReader,
        image_size: int,
        channels: int,
        augment: Augment | None,
        seed: int,
        mix: int,
    ) -> None:
        super().__init__(image_size, channels, augment, seed)
        # One reader for the task's train and embed sets: one bounded set of open shards per
        # process (a DataLoader worker unpickles a reader of its own).
        self.index, self.mix, self.reader = reader.index, mix, reader

    def __len__(self) -> int:
        return len(self.index)

    def data_digest(self) -> str:
        """What the run's checkpoints record of the data (``Task`` protocol): the digest of the
        shard index, so a folder packed again is other data."""
        return self.index.digest

    def _name(self, index: int) -> str:
        shard = int(self.index.shard_of(np.array([index]))[0])
        return f"{self.index.url(shard)}:{shard_format.key_of(index)}"

    def _decoded(self, index: int, data: bytes) -> torch.Tensor:
        return fit_square(decode(self._name(index), self.channels, data), self.image_size)

    def load(self, index: int) -> torch.Tensor:
        return self._decoded(index, self.reader.read([index])[0])

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        datas = self.reader.read(indices)
        return [self.item(self._decoded(i, d), i) for i, d in zip(indices, datas)]

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        return shard_format.epoch_order(self.index, seed, epoch, self.mix)


def _check(ok: bool, name: str, value: object, want: str, task: str = "ImageFolderTask") -> None:
    if not ok:
        raise UserError(f"task.params.{name} = {value!r} is invalid for {task}: {want}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The parameters both image tasks take, each declared once with the values it allows: submit
# refuses another value before anything is written (clusterflow.tasks.Range, OneOf).
ImageSize = Annotated[int, Range(8, 1024, what="pixels per side")]
Channels = Annotated[int, OneOf(1, 3, what="grey or RGB")]
Backbone = Annotated[str, OneOf(*BACKBONES)]
EmbedDim = Annotated[int, Range(2)]
Temperature = Annotated[float, Range(0, open_min=True, what="e.g. 0.1")]
CropScale = Annotated[float, Range(0, 1, open_min=True, what="the smallest crop's area fraction")]
RotateDeg = Annotated[float, Range(0, 180, what="degrees")]
Jitter = Annotated[float, Range(0, 1, open_max=True, what="a brightness/contrast range")]
Limit = Annotated[int, Range(0, what="a number of images, 0 for all")]
ScanLimit = Annotated[float, Range(0, what="the longest the scan of root may take, 0: no limit")]


@dataclass(frozen=True)
class EncoderShape:
    """The encoder an image task builds: ``backbone`` (small or resnet18) ``width`` channels wide
    (0: the backbone's default), over ``channels`` x ``image_size`` x ``image_size`` images, to
    ``embed_dim``."""

    backbone: str
    width: int
    channels: int
    image_size: int
    embed_dim: int


class ImageFolderTask(Task):
    """Parameters (``task.params``): root, image_size, channels, backbone, width, embed_dim,
    temperature, crop_scale, flip, rotate_deg, jitter, limit, make_digits, scan_limit_s
    (docs/tasks.md)."""

    def __init__(
        self,
        seed: int = 0,
        *,
        root: str = "",
        image_size: ImageSize = 32,
        channels: Channels = 3,
        backbone: Backbone = "small",
        width: int = 0,
        embed_dim: EmbedDim = 64,
        temperature: Temperature = 0.1,
        crop_scale: CropScale = 0.5,
        flip: bool = True,
        rotate_deg: RotateDeg = 10.0,
        jitter: Jitter = 0.3,
        limit: Limit = 0,
        make_digits: bool = False,
        scan_limit_s: ScanLimit = 600.0,
    ) -> None:
        self._configure(
            seed,
            root,
            "set it to a folder of images, e.g. task.params.root=data/digits",
            EncoderShape(backbone, width, channels, image_size, embed_dim),
            temperature,
            Augment(
                crop_scale=float(crop_scale),
                flip=flip,
                rotate_deg=float(rotate_deg),
                jitter=float(jitter),
            ),
        )
        if make_digits and (
            not os.path.exists(root) or (os.path.isdir(root) and not os.listdir(root))
        ):
            log.info(
                "task.params.root=%s is missing or empty: "
                "writing the scikit-learn digits there (make_digits)",
                root,
            )
            write_digits(root)
        files, labels, classes = scan(root, float(scan_limit_s))
        if limit and limit < len(files):
            # Evenly spaced over the sorted list, so a subset of a class-folder tree keeps every
            # class.
            keep = np.linspace(0, len(files) - 1, limit).round().astype(np.int64)
            files, labels = [files[i] for i in keep], labels[keep] if labels is not None else None
        self.files, self.labels, self.classes = files, labels, classes
        self.num_samples = len(files)
        log.info(
            "ImageFolderTask: %d images under %s, %s",
            len(files),
            root,
            f"{len(classes)} class folders (ground truth for mining quality)"
            if classes
            else "flat folder (no ground truth)",
        )

    def _configure(
        self,
        seed: int,
        root: str,
        what_root: str,
        shape: EncoderShape,
        temperature: float,
        augment: Augment,
    ) -> None:
        """Keep the parameters that do not depend on where the images are; root and width are
        checked here, the others by their annotations when the task is loaded (and at submit)."""
        task = type(self).__name__
        self.seed = seed
        _check(isinstance(root, str) and root != "", "root", root, what_root, task)
        backbone, width = shape.backbone, shape.width
        _check(
            _is_int(width) and (width == 0 or width >= 4),
            "width",
            width,
            "an integer >= 4, or 0 for the backbone's default (small 32, resnet18 64)",
            task=task,
        )
        self.root = root
        self.image_size, self.channels, self.temperature = (
            shape.image_size,
            shape.channels,
            temperature,
        )
        self.backbone, self.width, self.embed_dim = (
            backbone,
            width or (32 if backbone == "small" else 64),
            shape.embed_dim,
        )
        self.augment = augment
        self._train: ImageItems | None = None
        self._embed: ImageItems | None = None

    def build_model(self) -> nn.Module:
        return Encoder(self.backbone, self.channels, self.image_size, self.width, self.embed_dim)

    def train_dataset(self) -> ImageFiles:
        if self._train is None:
            self._train = ImageFiles(
                self.root, self.files, self.image_size, self.channels, self.augment, self.seed
            )
        return self._train

    def embed_dataset(self) -> ImageFiles:
        if self._embed is None:
            self._embed = ImageFiles(
                self.root, self.files, self.image_size, self.channels, None, self.seed
            )
        return self._embed

    def set_epoch(self, epoch: int) -> None:
        self.train_dataset().epoch = epoch

    def loss(
        self, model: nn.Module, batch: dict[str, Any], labels: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        index = batch["index"]
        if labels is None:
            ids = index  # before any mining round: each image is its own identity
        else:
            # -1 (ignored singleton): its own views only.
            ids = torch.where(labels >= 0, labels, self.num_samples + index)
        z = model(torch.cat([batch["x1"], batch["x2"]]))
        return supcon_loss(z.float(), torch.cat([ids, ids]), self.temperature)

    def embed(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return model(batch["x"])

    def ground_truth(self) -> np.ndarray | None:
        return self.labels


class ImageShardsTask(ImageFolderTask):
    """ImageFolderTask's training on images packed into tar shards (``python -m
    clusterflow.tasks.shards SRC_FOLDER OUT``). Parameters (``task.params``): root (the shard
    folder: a path or any fsspec URL), image_size, channels, backbone, width, embed_dim,
    temperature, crop_scale, flip, rotate_deg, jitter (as ImageFolderTask's; limit, make_digits and
    scan_limit_s are taken at their defaults only), and mix_shards: how many shards each part of
    an epoch's order mixes (docs/data.md)."""

    def __init__(
        self,
        seed: int = 0,
        *,
        root: str = "",
        image_size: ImageSize = 32,
        channels: Channels = 3,
        backbone: Backbone = "small",
        width: int = 0,
        embed_dim: EmbedDim = 64,
        temperature: Temperature = 0.1,
        crop_scale: CropScale = 0.5,
        flip: bool = True,
        rotate_deg: RotateDeg = 10.0,
        jitter: Jitter = 0.3,
        limit: Limit = 0,
        make_digits: bool = False,
        scan_limit_s: ScanLimit = 600.0,
        mix_shards: Annotated[int, Range(1, what="shards an epoch's order mixes at a time")] = 4,
    ) -> None:
        self._configure(
            seed,
            root,
            "set it to a folder of shards written by python -m clusterflow.tasks.shards",
            EncoderShape(backbone, width, channels, image_size, embed_dim),
            temperature,
            Augment(
                crop_scale=float(crop_scale),
                flip=flip,
                rotate_deg=float(rotate_deg),
                jitter=float(jitter),
            ),
        )
        # ImageFolderTask's folder parameters, so that one config serves both tasks; a shard
        # folder is packed beforehand and not scanned (scan_limit_s has nothing to limit).
        _check(
            limit == 0, "limit", limit, "0: pack the images to use into shards", "ImageShardsTask"
        )
        _check(
            make_digits is False,
            "make_digits",
            make_digits,
            "false: write the digits (python -m clusterflow.tasks.digits DIR), then pack them "
            "(python -m clusterflow.tasks.shards DIR OUT)",
            "ImageShardsTask",
        )
        self.mix_shards = mix_shards
        self.index = shard_format.ShardIndex.load(root)
        self.reader = shard_format.ShardReader(self.index)
        self.labels, self.classes = self.index.label, self.index.classes
        self.num_samples = len(self.index)
        log.info(
            "ImageShardsTask: %d images in %d shards under %s, %s",
            self.num_samples,
            len(self.index.shards),
            root,
            f"{len(self.classes)} classes (ground truth for mining quality)"
            if self.classes
            else "no classes (no ground truth)",
        )

    def train_dataset(self) -> ShardImages:
        if self._train is None:
            self._train = ShardImages(
                self.reader,
                self.image_size,
                self.channels,
                self.augment,
                self.seed,
                self.mix_shards,
            )
        return self._train

    def embed_dataset(self) -> ShardImages:
        if self._embed is None:
            self._embed = ShardImages(
                self.reader, self.image_size, self.channels, None, self.seed, self.mix_shards
            )
        return self._embed
