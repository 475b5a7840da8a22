"""The image-folder task: decoding, deterministic augmentations, rank independence, the digits
writer, every bad parameter, and a 2-rank `--local` run on a digits subset with mining rounds."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import run_cli
from multirank import run_ranks
from PIL import Image

from clusterflow.errors import UserError
from clusterflow.tasks import load_task
from clusterflow.tasks.augment import Augment, view_generator
from clusterflow.tasks.backbones import Encoder
from clusterflow.tasks.images import ImageFolderTask, UnreadableImage, decode, fit_square

TARGET = "clusterflow.tasks.images:ImageFolderTask"


def save(path, array, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(array).save(path, **kw)
    return str(path)


def classes_folder(root, per_class=6, size=(12, 10)):
    """Three classes of small random colour images, PNG and JPEG mixed."""
    rng = np.random.default_rng(0)
    for c in ("cat", "dog", "eel"):
        for i in range(per_class):
            ext = "png" if i % 2 else "jpg"
            save(
                os.path.join(root, c, f"{i}.{ext}"),
                rng.integers(0, 256, (*size, 3), dtype=np.uint8),
            )
    return str(root)


# -- decoding ----------------------------------------------------------------------------------


def test_decodes_grey_and_colour_png_and_jpeg_of_any_size(tmp_path):
    grey = save(tmp_path / "grey.png", np.full((8, 8), 128, np.uint8))
    red = np.zeros((23, 37, 3), np.uint8)
    red[..., 0] = 255
    jpg = save(tmp_path / "red.jpg", red, quality=95)
    rgba = save(tmp_path / "rgba.png", np.full((64, 5, 4), 200, np.uint8))
    for path, h, w in ((grey, 8, 8), (jpg, 23, 37), (rgba, 64, 5)):
        for channels in (1, 3):
            x = decode(path, channels)
            assert x.shape == (channels, h, w) and x.dtype == torch.float32
            assert 0 <= float(x.min()) and float(x.max()) <= 1
    assert torch.allclose(decode(grey, 3), torch.full((3, 8, 8), 128 / 255))
    rgb = decode(jpg, 3).mean((1, 2))
    assert rgb[0] > 0.95 and rgb[1] < 0.05 and rgb[2] < 0.05
    assert abs(float(decode(jpg, 1).mean()) - 0.299) < 0.02  # ITU-R 601 luma of pure red


def test_sixteen_bit_grey_keeps_its_range_and_exif_rotation_is_applied(tmp_path):
    deep = tmp_path / "deep.png"
    Image.fromarray(np.array([[0, 32768], [65535, 65535]], np.uint16)).save(deep)
    assert torch.allclose(
        decode(str(deep), 1)[0], torch.tensor([[0.0, 0.5], [1.0, 1.0]]), atol=1e-4
    )
    img = Image.fromarray(np.zeros((10, 20, 3), np.uint8))  # 20 wide, 10 high
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees to display"
    img.save(tmp_path / "phone.jpg", exif=exif)
    assert decode(str(tmp_path / "phone.jpg"), 3).shape == (3, 20, 10)


def test_fit_square_crops_the_centre_and_resizes():
    x = torch.zeros(1, 20, 40)
    x[:, :, 20:] = 1.0  # right half white
    sq = fit_square(x, 20)  # the centre 20x20: columns 10..29, half black, half white
    assert sq.shape == (1, 20, 20)
    assert float(sq[0, :, :10].max()) == 0.0 and float(sq[0, :, 10:].min()) == 1.0
    assert fit_square(x, 7).shape == (1, 7, 7) and fit_square(torch.rand(3, 5, 6), 32).shape == (
        3,
        32,
        32,
    )


# -- augmentations -----------------------------------------------------------------------------


def test_views_depend_only_on_seed_epoch_index_view():
    img = torch.rand(3, 16, 16)
    aug = Augment()
    same = aug(img, view_generator(1, 2, 3, 0))
    assert torch.equal(same, aug(img, view_generator(1, 2, 3, 0)))
    for other in (
        (1, 2, 3, 1),
        (1, 3, 3, 0),
        (1, 2, 4, 0),
        (2, 2, 3, 0),
    ):  # view, epoch, index, seed
        assert not torch.allclose(same, aug(img, view_generator(*other)))
    assert same.shape == img.shape and 0 <= float(same.min()) and float(same.max()) <= 1


def test_no_augmentation_is_the_identity_and_flip_mirrors():
    img = torch.rand(1, 12, 12)
    plain = Augment(crop_scale=1.0, flip=False, rotate_deg=0.0, jitter=0.0)
    for v in range(8):
        assert torch.allclose(plain(img, view_generator(0, 0, 0, v)), img, atol=1e-5)
    flipping = Augment(crop_scale=1.0, flip=True, rotate_deg=0.0, jitter=0.0)
    outs = [flipping(img, view_generator(0, 0, 0, v)) for v in range(16)]
    mirrored = sum(torch.allclose(o, img.flip(-1), atol=1e-5) for o in outs)
    unchanged = sum(torch.allclose(o, img, atol=1e-5) for o in outs)
    assert mirrored + unchanged == 16 and 0 < mirrored < 16


def test_dataset_items_change_with_the_epoch_not_with_repetition(tmp_path):
    task = ImageFolderTask(root=classes_folder(tmp_path / "imgs"), image_size=16)
    ds = task.train_dataset()
    a = ds[3]
    assert set(a) == {"x1", "x2", "index"} and a["x1"].shape == (3, 16, 16) and a["index"] == 3
    assert torch.equal(a["x1"], ds[3]["x1"]) and not torch.equal(a["x1"], a["x2"])
    task.set_epoch(1)
    assert not torch.equal(a["x1"], ds[3]["x1"])
    e = task.embed_dataset()[3]
    assert set(e) == {"x", "index"} and torch.equal(e["x"], task.embed_dataset()[3]["x"])


def _rank_batches(root, workers):
    """This rank's micro-batches of epoch 1, decoded by DataLoader workers as the trainer does."""
    from clusterflow.distributed import comm as dist
    from clusterflow.distributed.sampler import GlobalBatchSampler

    task = ImageFolderTask(seed=5, root=root, image_size=12)
    ds = task.train_dataset()
    sampler = GlobalBatchSampler(len(ds), 6, dist.rank(), dist.world(), 5)
    task.set_epoch(1)
    sampler.set_epoch(1)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=workers)
    return [
        {k: b[k].numpy() for k in ("x1", "x2", "index")} for b in loader
    ]  # numpy: pickled by value across processes


def test_one_and_two_ranks_train_on_identical_pixels(tmp_path):
    root = classes_folder(tmp_path / "imgs")
    single = _rank_batches(root, 0)
    r0, r1 = run_ranks(2, _rank_batches, root, 1)
    assert len(single) == len(r0) == len(r1) == 3
    for whole, a, b in zip(single, r0, r1):
        for key in ("x1", "x2", "index"):
            assert np.array_equal(whole[key], np.concatenate([a[key], b[key]])), key


# -- folders, the digits writer ----------------------------------------------------------------


def test_class_folders_give_ground_truth_and_a_flat_folder_none(tmp_path):
    task = ImageFolderTask(root=classes_folder(tmp_path / "classes", per_class=4))
    assert (
        task.classes == ["cat", "dog", "eel"]
        and task.ground_truth().tolist() == [0] * 4 + [1] * 4 + [2] * 4
    )
    assert ImageFolderTask(root=str(tmp_path / "classes"), limit=6).ground_truth().tolist() == [
        0,
        0,
        1,
        1,
        2,
        2,
    ]
    flat = tmp_path / "flat"
    for i in range(5):
        save(flat / f"{i}.png", np.full((9, 7), i * 40, np.uint8))
    (flat / "notes.txt").write_text("not an image")
    task = ImageFolderTask(root=str(flat), channels=1, image_size=8)
    assert task.ground_truth() is None and len(task.embed_dataset()) == 5
    assert task.embed_dataset()[4]["x"].shape == (1, 8, 8)


def test_digits_writer_writes_the_real_scans(tmp_path):
    from sklearn.datasets import load_digits

    out = tmp_path / "digits"
    res = run_cli("clusterflow.tasks.digits", str(out))
    assert res.returncode == 0 and "wrote 1797 digit images" in res.stdout, res.stderr
    assert sorted(os.listdir(out)) == [str(d) for d in range(10)]
    digits = load_digits()
    for i in (0, 1000, 1796):
        png = np.asarray(Image.open(out / str(digits.target[i]) / f"{i:04d}.png"))
        assert png.shape == (8, 8) and np.array_equal(
            png, np.rint(digits.images[i] * 255 / 16).astype(np.uint8)
        )
    task = ImageFolderTask(root=str(out), channels=1)
    assert np.array_equal(np.bincount(task.ground_truth()), np.bincount(digits.target))
    again = run_cli("clusterflow.tasks.digits", str(out))
    assert again.returncode == 2 and "already exists and is not an empty folder" in again.stderr
    assert "Traceback" not in again.stderr


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params,message",
    [
        ({"root": ""}, "task.params.root = '' is invalid"),
        ({"root": "{tmp}/nowhere"}, "does not exist; point it at a folder of images"),
        ({"root": "{tmp}/file.png"}, "is a file, not a folder"),
        ({"root": "{tmp}/empty"}, "is an empty folder"),
        (
            {"root": "{tmp}/texts"},
            "holds no image files (1 entries, e.g. 'a.txt'); accepted extensions",
        ),
        (
            {"root": "{tmp}/mixed"},
            "holds both image files (top.png, ...) and class folders with images (c/, ...)",
        ),
        (
            {"image_size": 4},
            (
                "task.params.image_size = 4 is out of range for ImageFolderTask: must be >= 8 and "
                "<= 1024 (pixels per side)"
            ),
        ),
        ({"image_size": "32"}, "task.params.image_size = '32' is invalid"),
        ({"image_size": True}, "task.params.image_size = True is invalid"),
        (
            {"channels": 2},
            (
                "task.params.channels = 2 is out of range for ImageFolderTask: must be one of 1, 3 "
                "(grey or RGB)"
            ),
        ),
        (
            {"backbone": "vgg"},
            (
                "task.params.backbone = 'vgg' is out of range for ImageFolderTask: must be one of "
                "small, resnet18"
            ),
        ),
        ({"width": 2}, "task.params.width = 2 is invalid"),
        ({"embed_dim": 1}, "task.params.embed_dim = 1 is out of range"),
        ({"temperature": 0}, "task.params.temperature = 0 is out of range"),
        ({"temperature": float("nan")}, "task.params.temperature = nan is out of range"),
        ({"crop_scale": 0}, "task.params.crop_scale = 0 is out of range"),
        ({"flip": "no"}, "task.params.flip = 'no' is invalid"),
        ({"rotate_deg": -1}, "task.params.rotate_deg = -1 is out of range"),
        ({"jitter": 1}, "task.params.jitter = 1 is out of range"),
        ({"limit": -1}, "task.params.limit = -1 is out of range"),
        ({"scan_limit_s": -1}, "task.params.scan_limit_s = -1 is out of range"),
        ({"make_digits": 1}, "task.params.make_digits = 1 is invalid"),
        ({"colour": 3}, "unexpected keyword argument 'colour'"),
    ],
)
def test_bad_params_are_one_line_user_errors(tmp_path, params, message):
    save(tmp_path / "file.png", np.zeros((4, 4), np.uint8))
    os.makedirs(tmp_path / "empty")
    os.makedirs(tmp_path / "texts")
    (tmp_path / "texts" / "a.txt").write_text("x")
    save(tmp_path / "mixed" / "top.png", np.zeros((4, 4), np.uint8))
    save(tmp_path / "mixed" / "c" / "in.png", np.zeros((4, 4), np.uint8))
    save(tmp_path / "ok" / "a.png", np.zeros((4, 4), np.uint8))
    params = {"root": str(tmp_path / "ok"), **params}
    params = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in params.items()}
    with pytest.raises(UserError) as exc:
        load_task(TARGET, 0, params)
    assert message.format(tmp=tmp_path) in str(exc.value)
    assert "\n" not in str(exc.value)


def test_unreadable_image_names_the_file_even_from_a_worker(tmp_path):
    root = classes_folder(tmp_path / "imgs", per_class=2)
    bad = os.path.join(root, "dog", "9.png")
    open(bad, "wb").write(b"\x89PNG but not really")
    ds = ImageFolderTask(root=root).train_dataset()
    with pytest.raises(UnreadableImage, match="cannot decode image .*9.png"):
        ds[len(ds) - 3]  # dog/9.png sorts after dog/0.jpg and dog/1.png
    loader = torch.utils.data.DataLoader(ds, batch_size=len(ds), num_workers=1)
    with pytest.raises(UnreadableImage) as exc:
        next(iter(loader))
    assert str(exc.value).startswith(
        f"cannot decode image {bad} (UnidentifiedImageError"
    ) and "\n" not in str(exc.value)


# -- models and end to end ---------------------------------------------------------------------


@pytest.mark.parametrize("backbone,size", [("small", 16), ("resnet18", 32), ("resnet18", 96)])
def test_backbones_give_normalised_embeddings(backbone, size):
    torch.manual_seed(0)
    model = Encoder(backbone, 3, size, 8, 16)
    z = model(torch.randn(2, 3, size, size))
    assert z.shape == (2, 16) and torch.allclose(z.norm(dim=1), torch.ones(2), atol=1e-5)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())  # rank-independent


SMALL_DIGITS = [
    "task.params.limit=256",
    "train.epochs=3",
    "train.batch_size=64",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
    "train.progress_bar=false",
    "mining.start_epoch=1",
    "mining.every_epochs=1",
    "mining.k=10",
    "mining.threshold=0.5",
    "mining.max_cluster_size=60",
]


def check_small_digits_run(run_dir, root):
    assert (
        sum(len(files) for _, _, files in os.walk(root)) == 1797
    )  # make_digits wrote the whole set, once
    status = json.load(open(run_dir / "status.json"))
    assert status["state"] == "completed" and status["world_size"] == 2
    assert [r["epoch"] for r in status["mining"]] == [1, 2]
    for r in status["mining"]:
        assert r["num_samples"] == 256 and 0 <= r["nmi"] <= 1 and -1 <= r["ari"] <= 1
    assert os.path.exists(run_dir / "model.pt")


@pytest.mark.slow  # 22 s on a quiet 2-core machine, 45 s on a busy one
def test_digits_config_runs_locally_on_two_ranks_with_mining(tmp_path):
    """Both ranks find the digits folder missing and write it at once; one copy wins, whole
    (each writes under a name of its host and pid, so ranks on two nodes race the same way)."""
    run_dir, root = tmp_path / "run", tmp_path / "digits"
    res = run_cli(
        "clusterflow.submit",
        "configs/images_digits.yaml",
        f"run.dir={run_dir}",
        f"task.params.root={root}",
        *SMALL_DIGITS,
        "--local",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    check_small_digits_run(run_dir, root)
    assert not [d for d in os.listdir(tmp_path) if ".tmp-" in d]  # the losing copy was cleaned up
