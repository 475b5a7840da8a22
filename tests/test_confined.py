"""storage/confined.py, the one opener of every record a reader of a run dir takes: a regular
file reached from its folder without a link, opened without blocking, within a size."""

import os
import socket

import pytest

from clusterflow.storage import confined


def test_only_a_regular_file_reached_without_a_link_is_read(tmp_path):
    run = tmp_path / "run"
    (run / "heartbeats").mkdir(parents=True)
    (run / "heartbeats" / "rank0.json").write_text("inside")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "rank0.json").write_text("outside")
    assert confined.read_bytes(str(run / "heartbeats" / "rank0.json"), str(run)) == b"inside"
    # The folder given may itself be a link (the user's own path to the run dir).
    os.symlink(run, tmp_path / "alias")
    alias = str(tmp_path / "alias")
    assert confined.read_bytes(os.path.join(alias, "heartbeats", "rank0.json"), alias) == b"inside"

    os.symlink(tmp_path / "elsewhere" / "rank0.json", run / "status.json")
    with pytest.raises(confined.Refused, match=r"is a symbolic link \(to .*elsewhere/rank0.json"):
        confined.read_bytes(str(run / "status.json"))
    os.symlink(tmp_path / "elsewhere", run / "timeline")
    with pytest.raises(confined.Refused, match=r"reached through a symbolic link .*/run/timeline"):
        confined.read_bytes(str(run / "timeline" / "rank0.json"), str(run))
    # A link that stays inside is refused all the same: a record is never a link.
    os.symlink("heartbeats/rank0.json", run / "inner.json")
    with pytest.raises(confined.Refused, match="symbolic link"):
        confined.read_bytes(str(run / "inner.json"))
    with pytest.raises(confined.Refused, match="is not inside"):
        confined.read_bytes(str(run / ".." / "elsewhere" / "rank0.json"), str(run))
    with pytest.raises(FileNotFoundError):
        confined.read_bytes(str(run / "nothing.json"))
    with pytest.raises(FileNotFoundError):
        confined.read_bytes(str(run / "no-folder" / "x.json"), str(run))


def test_a_fifo_a_socket_a_device_or_a_folder_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # opened for reading as a file, it would wait for a writer
    with pytest.raises(confined.Refused, match=r"is a FIFO \(named pipe\), not a regular file"):
        confined.read_bytes(str(tmp_path / "fifo"))
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        with pytest.raises(confined.Refused, match="is a socket"):
            confined.read_bytes(str(tmp_path / "sock"))
    with pytest.raises(confined.Refused, match="is a character device"):
        confined.read_bytes("/dev/zero")  # endless: read whole, it would never end
    (tmp_path / "d").mkdir()
    with pytest.raises(confined.Refused, match="is a folder"):
        confined.read_bytes(str(tmp_path / "d"))
    # A FIFO in place of a folder on the way: not opened either.
    with pytest.raises(NotADirectoryError):
        confined.read_bytes(str(tmp_path / "fifo" / "x.json"), str(tmp_path))


def test_a_file_over_its_limit_is_refused_by_its_size_unread(tmp_path):
    target = tmp_path / "big.json"
    with open(target, "wb") as f:
        f.truncate(3 * 2**20)  # sparse
    with pytest.raises(confined.TooLarge, match=r"is 3 MiB, more than the 1 MiB") as got:
        confined.read_bytes(str(target), limit=2**20)
    assert got.value.size == 3 * 2**20
    assert len(confined.read_bytes(str(target), limit=4 * 2**20)) == 3 * 2**20
    assert isinstance(got.value, OSError)  # readers that take any OSError as damage do so
