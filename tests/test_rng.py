"""checkpoint/rng.py: a rank's random streams come back exactly, from what this version saves
and from the forms checkpoints of earlier versions hold."""

import random

import numpy as np
import pytest
import torch

from clusterflow.checkpoint.rng import capture_rng, restore_rng
from clusterflow.storage.tensors import PACKED, TORCH


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


@pytest.mark.parametrize(
    "form",
    [
        lambda words: words,  # this version: bytes of 64-bit words
        lambda words: torch.tensor(np.frombuffer(words, dtype=np.uint64).astype(np.int64)),
        lambda words: np.frombuffer(words, dtype=np.uint64).tolist(),
    ],
    ids=["bytes", "int64-tensor", "list"],
)
@pytest.mark.parametrize("codec", [TORCH, PACKED], ids=["torch.save", "packed"])
def test_the_streams_come_back_from_every_saved_form(tmp_path, form, codec):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    _draws()
    state = capture_rng()
    version, words, gauss = state["python"]
    state["python"] = [version, form(words), gauss]
    path = str(tmp_path / "rng")
    with open(path, "wb") as f:
        codec.dump(state, f)
    expected = _draws()
    _draws()
    restore_rng(codec.load(path))
    assert _draws() == expected
