"""`clusterflow dashboard --list`: the dashboards this user runs on this host, from files only the
user can read; those whose process is gone are left out (and their files removed)."""

import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from clusterflow.errors import UserError
from clusterflow.web import running


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state" / "clusterflow" / "dashboards"


def test_a_running_dashboard_is_listed_from_a_file_only_its_user_reads(state):
    target = running.register("http://127.0.0.1:4242/?token=abc", ["/runs"])
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    (entry,) = running.running()
    assert (entry.url, entry.paths, entry.pid) == (
        "http://127.0.0.1:4242/?token=abc",
        ["/runs"],
        os.getpid(),
    )
    assert "http://127.0.0.1:4242/?token=abc  (pid" in running.render([entry])
    running.unregister(target)
    assert running.running() == [] and "no dashboard of yours runs on" in running.render([])


def test_a_dashboard_whose_process_is_gone_or_on_another_host_is_not_listed(state):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    os.makedirs(state, mode=0o700)
    host = socket.gethostname()
    for name, rec in (
        (f"{host}-{gone.pid}.json", {"pid": gone.pid, "pid_start": "1", "host": host}),
        ("elsewhere-1.json", {"pid": os.getpid(), "pid_start": "1", "host": "elsewhere"}),
        (f"{host}-garbage.json", None),
    ):
        with open(state / name, "w") as f:
            f.write("not json" if rec is None else json.dumps({"url": "u", **rec}))
    assert running.running() == []
    assert sorted(os.listdir(state)) == ["elsewhere-1.json", f"{host}-garbage.json"]


def test_a_folder_others_may_read_is_refused(state):
    os.makedirs(state, mode=0o755)
    os.chmod(state, 0o755)
    with pytest.raises(UserError, match="others may read it .mode 755.; make it yours alone"):
        running.register("http://x/?token=t", ["/runs"])
