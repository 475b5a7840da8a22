"""durable.write_file: a codec's dump held in memory while it is small (one write, one hash, no
thread), streamed and hashed as it grows once it outgrows a chunk; the same bytes and the same
record either way."""

import os
import threading

import pytest
import torch

from clusterflow.storage import durable
from clusterflow.storage.tensors import TORCH, serialize


def _record_of(path):
    algorithm, h = durable.new_hash()
    with open(path, "rb") as f:
        h.update(f.read())
    return {"size": os.path.getsize(path), algorithm: h.hexdigest()}


def _state(n):
    g = torch.Generator().manual_seed(n)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(7), "step": 3}


@pytest.mark.parametrize("chunk", [256, 4096, 64 << 10, None])
def test_a_dump_small_or_spilled_writes_what_torch_save_writes(tmp_path, monkeypatch, chunk):
    if chunk is not None:  # the dump crosses the chunk early, in the middle of a record
        monkeypatch.setattr(durable, "_CHUNK", chunk)
    obj = _state(20_000)
    path = str(tmp_path / "model.pt")
    info = durable.write_file(path, obj, fsync=True, codec=TORCH)
    with open(path, "rb") as f:
        assert f.read() == serialize(obj)
    assert info == _record_of(path)
    loaded = durable.load_checked("model.pt", path, info, TORCH)
    assert torch.equal(loaded["w"], obj["w"]) and loaded["step"] == 3


def test_a_file_larger_than_a_chunk_streams(tmp_path):
    obj = {"w": torch.ones((durable._CHUNK + (1 << 20)) // 4)}
    path = str(tmp_path / "big.pt")
    info = durable.write_file(path, obj, fsync=False, codec=TORCH)
    assert info["size"] > durable._CHUNK and info == _record_of(path)


def test_a_small_dump_starts_no_thread(tmp_path, monkeypatch):
    def no_thread(self, *a, **k):
        raise AssertionError("a small file started a thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    path = str(tmp_path / "small.pt")
    info = durable.write_file(path, _state(1000), fsync=True, codec=TORCH)
    assert info == _record_of(path)


def test_a_dump_that_fails_after_spilling_closes_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(durable, "_CHUNK", 1024)

    def dump(obj, sink):
        sink.write(b"x" * 4000)  # spilled: the file and its hasher are open
        raise RuntimeError("the codec failed")

    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    codec = durable.Codec(dump=dump, load=TORCH.load)
    with pytest.raises(RuntimeError, match="the codec failed"):
        durable.write_file(str(tmp_path / "x.pt"), {"a": 1}, codec=codec)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert threading.active_count() == threads  # the hasher thread joined
