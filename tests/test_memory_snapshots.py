"""Snapshots in the nodes' memory (checkpoint.memory_every_steps), on real files, real sockets and
real processes: replicas arrive verified and two generations stay; a sender killed while sending,
a flipped bit and a stranger leave no replica; a 2-rank run whose rank 1 is SIGKILLed resumes
from the memory of its nodes, from a peer's replica when a node's memory is gone, from the other
copy when one is damaged, from the shared filesystem when a rank has no sound copy left: each
said in one line, each bitwise equal to an uninterrupted run. The ranks run as two "nodes" on
this machine, each in a UTS namespace of its own (``tests/launch.py``'s ``nodes``), so that
``memory_dir=.../{node}`` keeps them apart as two machines would. The restarts on the real
Slurm cluster are in tests/test_slurm_recovery.py."""

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from types import SimpleNamespace

import launch
import pytest
import torch
from conftest import REPO, weights_equal

from clusterflow.checkpoint import identity
from clusterflow.checkpoint.memory import MemoryRestore, MemorySnapshots, history_bounds, peer_of
from clusterflow.distributed.env import address_toward
from clusterflow.manage.status import collect
from clusterflow.rundir import RunPaths, timeline
from clusterflow.storage import private, replica, snapshots
from clusterflow.storage.names import MANIFEST, MODEL, TRAIN_STATE
from clusterflow.storage.snapshots import OWN, REPLICA, Key, NodeSnapshots
from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import PACKED

TOKEN = uuid.uuid4().hex  # a run's token, as rank 0 draws it


def _node(folder):
    """A node's run folder, made as ``snapshots.open_folder`` makes one."""
    private.make(str(folder))
    return NodeSnapshots(str(folder), PACKED, identity.check)


def _commit(node, key, step, size=1000):
    """A snapshot of ``step`` in ``node``'s own folder (rank ``key.rank``): its path."""
    ident = identity.new_id()
    files = identity.stamp(
        {
            MODEL: {"w": torch.arange(size, dtype=torch.float32) * step},
            TRAIN_STATE: {"rng": [{"torch": torch.get_rng_state()}], "step": step},
        },
        ident,
        step,
    )
    meta = {
        "checkpoint_id": ident,
        "rank": key.rank,
        "world_size": key.world,
        "attempt": key.attempt,
        "position": [0, step, 0],
    }
    return node.store(key).save(step, files, meta)


@pytest.mark.parametrize(
    "hosts, expected",
    [
        (["a", "a"], [None, None]),  # one node: no replica
        (["a", "b"], [1, 0]),
        (["a", "b", "c"], [1, 2, 0]),
        (["a", "a", "b", "b"], [2, 3, 0, 1]),  # the same local index on the next node
        (["a", "a", "b"], [2, 2, 0]),
    ],
)
def test_each_rank_replicates_to_the_next_node(hosts, expected):
    assert [peer_of(r, hosts) for r in range(len(hosts))] == expected


def test_sets_newer_than_a_later_attempts_restore_were_abandoned(tmp_path):
    """Attempt 1 trained to step 10 and left snapshots of it; attempt 2 resumed from step 4 (say
    the memory was lost and the shared filesystem had step 4) and left snapshots of step 6: the
    step-10 set is a future the run abandoned, never restored, although it is newer and
    complete. Each rank's own node's copy comes first; a set older than the shared filesystem's
    newest checkpoint is not used."""
    paths = RunPaths(str(tmp_path))
    for attempt, restored in ((0, 0), (1, 8), (2, 4)):
        timeline.write(paths, {"attempt": attempt, "restored_step": restored})
    me = MemoryRestore(None, 3, history_bounds(timeline.read_all(paths), 3))
    at = (1, 4, 10)  # a position; every set below is at least as new as the shared (4, (0, 4, 4))
    gathered = [
        ("n1", [(Key(OWN, 1, 0, 2), 10, at), (Key(REPLICA, 1, 1, 2), 10, at)]),
        ("n2", [(Key(OWN, 1, 1, 2), 10, at), (Key(REPLICA, 1, 0, 2), 10, at)]),
        ("n1", [(Key(OWN, 2, 0, 2), 6, at), (Key(REPLICA, 2, 1, 2), 6, at)]),
        ("n2", [(Key(OWN, 2, 1, 2), 6, at), (Key(REPLICA, 2, 0, 2), 6, at)]),
    ]
    sets = me._sets(gathered, (4, (0, 4, 4)))
    assert [(s[0][0].step, s[0][0].key.attempt) for s in sets] == [(6, 2)]
    assert [(c.key.kind, c.node, c.reader) for c in sets[0][1]] == [
        (OWN, "n2", 3),
        (REPLICA, "n1", 2),
    ]
    assert me._sets(gathered, (8, (1, 2, 8))) == []  # the shared is newer


@pytest.mark.parametrize(
    "restored, unreadable, expected",
    [
        ({}, set(), {2: math.inf, 1: math.inf, 0: math.inf}),  # no resume went back
        # Attempt 2 resumed from step 4: attempts 0 and 1 keep their steps up to 4 only.
        ({0: 0, 1: 8, 2: 4}, set(), {2: math.inf, 1: 4, 0: 4}),
        # Attempt 1's timeline cannot be read: nothing of attempt 0 is trusted.
        ({2: 6}, {1}, {2: math.inf, 1: 6, 0: -1}),
    ],
)
def test_the_bounds_of_each_earlier_attempt_come_from_the_later_resumes(
    restored, unreadable, expected
):
    records = timeline.Timelines(
        records={a: {"restored_step": s} for a, s in restored.items()}, unreadable=unreadable
    )
    assert history_bounds(records, 3) == expected


def test_replicas_arrive_verified_and_two_generations_stay(tmp_path):
    mine, theirs = _node(tmp_path / "n1"), _node(tmp_path / "n2")
    key = Key(OWN, 3, 1, 2)
    receiver = replica.Receiver(theirs, TOKEN, "127.0.0.1", senders=["127.0.0.1"])
    try:
        for step in (2, 4, 6):
            replica.send(receiver.address, TOKEN, key, step, _commit(mine, key, step))
    finally:
        receiver.close()
    got = Key(REPLICA, 3, 1, 2)
    assert theirs.keys() == [got]
    assert theirs.store(got).steps() == [4, 6]
    ckpt = theirs.verify(got, 6)  # every digest and the ids inside the files checked
    assert torch.equal(ckpt.objects[MODEL]["w"], torch.arange(1000, dtype=torch.float32) * 6)
    assert [(e.key, e.step) for e in theirs.inventory()] == [(got, 4), (got, 6)]


# Sends a snapshot through the real replica.send, but dies (SIGKILL) after the first MiB of its
# files has left: a peer that dies while sending.
_DYING_SENDER = textwrap.dedent(
    """
    import os, signal, socket, sys
    from clusterflow.storage import replica
    from clusterflow.storage.snapshots import Key

    def sendfile(self, f, *args):
        self.sendall(f.read(1 << 20))
        os.kill(os.getpid(), signal.SIGKILL)

    socket.socket.sendfile = sendfile
    host, port, folder, token = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    replica.send((host, port), token, Key("own", 0, 0, 2), 8, folder)
    """
)


def test_a_sender_killed_while_sending_leaves_no_replica(tmp_path, caplog):
    mine, theirs = _node(tmp_path / "n1"), _node(tmp_path / "n2")
    key = Key(OWN, 0, 0, 2)
    _commit(mine, key, 4)
    receiver = replica.Receiver(theirs, TOKEN, "127.0.0.1", senders=["127.0.0.1"])
    try:
        replica.send(receiver.address, TOKEN, key, 4, mine.store(key).step_path(4))
        big = _commit(mine, key, 8, size=4 << 20)  # 16 MiB of weights
        out = subprocess.run(
            [sys.executable, "-c", _DYING_SENDER, *map(str, receiver.address), big, TOKEN],
            check=False,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == -signal.SIGKILL, out.stderr
        deadline = time.time() + 60
        while "not kept" not in caplog.text and time.time() < deadline:
            time.sleep(0.05)
    finally:
        receiver.close()
    (line,) = [r.getMessage() for r in caplog.records if "not kept" in r.getMessage()]
    assert line.startswith("replica of rank 0's snapshot of step 8 from 127.0.0.1 not kept: ")
    assert "connection closed after 1048576 of " in line and "the sender died" in line, line
    got = Key(REPLICA, 0, 0, 2)
    assert theirs.store(got).steps() == [4]  # the previous replica whole, nothing half-written
    assert os.listdir(theirs.store(got).root) == ["step-4"]


def test_an_older_attempts_snapshots_go_once_two_generations_are_newer(tmp_path):
    """Attempt 1 resumed from step 4 of attempt 0, which had reached step 10: attempt 0's
    snapshots stay while attempt 1's two generations are older than its newest (a restore may
    still need them) and go once both are newer; after that, commits stop looking for them."""
    node = _node(tmp_path)
    old = Key(OWN, 0, 0, 2)
    for step in (8, 10):
        _commit(node, old, step)
    key = Key(OWN, 1, 0, 2)
    me = SimpleNamespace(local=node, store=node.store(key), attempt=1, _older_left=True)
    for step, left in ((4, True), (6, True), (12, True), (14, False)):
        _commit(node, key, step)
        MemorySnapshots._drop_older(me)
        assert me._older_left is left
        listed = node.keys()
        assert (old in listed) is left
    assert node.store(key).steps() == [12, 14]


_OWN = ("files", "versions", "committed_at", "step")  # the receiver's store writes these


def _raw_send(address, header, payload, token=TOKEN):
    with socket.create_connection(address, timeout=30) as conn:
        data = json.dumps(header).encode()
        conn.sendall(token.encode() + struct.pack(">Q", len(data)) + data + payload)
        return conn.makefile("rb").readline().decode().strip()


def test_a_flipped_bit_and_a_stranger_leave_no_replica(tmp_path, caplog):
    mine, theirs = _node(tmp_path / "n1"), _node(tmp_path / "n2")
    key = Key(OWN, 0, 1, 2)
    folder = _commit(mine, key, 4)
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    names = list(manifest["files"])
    payload = b"".join(open(os.path.join(folder, n), "rb").read() for n in names)
    flipped = bytearray(payload)
    flipped[len(flipped) // 2] ^= 1
    header = {
        "attempt": 0,
        "rank": 1,
        "world": 2,
        "step": 4,
        "meta": {k: v for k, v in manifest.items() if k not in _OWN},
        "files": manifest["files"],
    }
    receiver = replica.Receiver(theirs, TOKEN, "127.0.0.1", senders=["127.0.0.1"])
    try:
        said = _raw_send(receiver.address, header, bytes(flipped))
        assert said.startswith("error: ") and "arrived with another blake3 digest" in said, said
        assert "arrived with another blake3 digest" in caplog.text
        said = _raw_send(receiver.address, header, payload, token="guess".ljust(len(TOKEN), "0"))
        assert said == "error: not a sender of this run"
        said = _raw_send(receiver.address, {**header, "rank": 2}, payload)
        assert said == "error: rank 2 of 2 ranks"
        assert _raw_send(receiver.address, header, payload) == "ok"  # the same, unharmed
    finally:
        receiver.close()
    assert theirs.store(Key(REPLICA, 0, 1, 2)).steps() == [4]
    assert len(os.listdir(theirs.store(Key(REPLICA, 0, 1, 2)).root)) == 1


# -- a shared node: another user, a stranger on the network -------------------------------------

KEY = "0123456789abcdef"  # a run's folder key, as snapshots.folder_key draws one


def test_a_folder_not_the_users_alone_is_never_used(tmp_path):
    """The run's folder in a node's memory made first by another user (0777, a snapshot folder
    in it), the user's own but open to others, a link, or below a memory dir others can write
    (no sticky bit) or another user's: refused, naming it and why, and nothing in it read,
    written or removed (the clear command too). Made by the run: 0700, its files 0600, whatever
    the umask; found again so: used."""
    d = str(tmp_path / "run")
    os.makedirs(d)
    record = RunPaths(d).memory_key
    with open(record, "w") as f:
        f.write(KEY + "\n")
    node = snapshots.node_name()  # the clear command's node is this machine
    with _shared_memory([node]) as memory:
        where = f"{memory}/{{node}}"
        folder = snapshots.run_folder(where, d, node, KEY)

        def refused(where=where):
            with pytest.raises(private.Unsafe) as caught:
                snapshots.open_folder(where, d, node, KEY)
            return str(caught.value)

        out = _as_nobody("sh", "-c", f"mkdir -m 0777 {folder} && mkdir {folder}/own-a0-r0-w1")
        assert out.returncode == 0, out.stderr
        assert refused() == (
            f"{folder} belongs to user nobody (uid 65534), not to this job's user root (uid 0)"
        )
        assert snapshots.main([where, d, record]) == 1
        assert os.listdir(folder) == ["own-a0-r0-w1"]
        assert _as_nobody("rm", "-r", folder).returncode == 0

        os.mkdir(folder)
        os.chmod(folder, 0o755)
        assert refused() == f"{folder} is open to other users (mode 0755, not 0700)"
        os.rmdir(folder)
        os.mkdir(tmp_path / "mine", 0o700)
        os.symlink(tmp_path / "mine", folder)
        assert refused() == f"{folder} is a symbolic link (to {tmp_path}/mine), not a folder"
        os.unlink(folder)

        writable = f"{memory}/{node}/writable"
        os.mkdir(writable)
        os.chmod(writable, 0o777)
        assert refused(f"{writable}/{{node}}") == (
            f"{writable} is writable by other users (mode 0777, without the sticky bit /dev/shm "
            + "has): they could move the run's folders in it aside"
        )
        theirs = f"{memory}/{node}/theirs"
        assert _as_nobody("mkdir", "-m", "0755", theirs).returncode == 0
        assert refused(f"{theirs}/{{node}}") == (
            f"{theirs} belongs to user nobody (uid 65534), who could move the run's folders in "
            + "it aside"
        )
        assert os.listdir(writable) == [] and os.listdir(theirs) == []

        umask = os.umask(0)
        try:
            made = snapshots.open_folder(where, d, node, KEY)
            _commit(NodeSnapshots(made, PACKED, identity.check), Key(OWN, 0, 0, 1), 3)
        finally:
            os.umask(umask)
        assert made == folder
        for top, _, files in os.walk(folder):
            assert stat.S_IMODE(os.lstat(top).st_mode) == 0o700, top
            for name in files:
                assert stat.S_IMODE(os.lstat(os.path.join(top, name)).st_mode) == 0o600, name
        assert snapshots.open_folder(where, d, node, KEY) == folder
        listed = NodeSnapshots(folder, PACKED, identity.check).inventory()
        assert [(e.key, e.step) for e in listed] == [(Key(OWN, 0, 0, 1), 3)]
        assert snapshots.main([where, d, record]) == 0 and not os.path.exists(folder)


def _netns(node, code, *args):
    """``python -c code ARGS`` in the network namespace of the test cluster's ``node``: a process
    on another machine of the cluster's network."""
    return subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{node}", sys.executable, "-c", code, *map(str, args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


# Opens N connections to a receiver and sends nothing; a line per connection the receiver closed
# (or "said" when it sent anything), then "done <closed>".
_IDLE = textwrap.dedent(
    """
    import select, socket, sys
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    left = {socket.create_connection((host, port), timeout=60) for _ in range(n)}
    closed = 0
    while left:
        ready, _, _ = select.select(list(left), [], [], 120)
        if not ready:
            break
        for c in ready:
            try:
                data = c.recv(4096)
            except ConnectionResetError:
                data = b""
            if data:
                print("said", data, flush=True)
                continue
            left.discard(c)
            closed += 1
            print("closed", closed, flush=True)
    print("done", closed, flush=True)
    """
)

# Sends rank 1's snapshot of step 4 through the real replica.send, from the address SOURCE.
_SEND = textwrap.dedent(
    """
    import sys
    from clusterflow.storage import replica
    from clusterflow.storage.snapshots import Key

    host, port, folder, token, source = sys.argv[1:6]
    try:
        replica.send(
            (host, int(port)), token, Key("own", 0, 1, 2), 4, folder, timeout_s=60, source=source
        )
        print("sent")
    except (replica.ReplicaError, OSError) as exc:
        print("refused:", type(exc).__name__, exc)
    """
)


def test_the_receiver_gives_a_stranger_nothing(cluster, tmp_path):
    """A receiver whose sender is on node1 of the test cluster, with other machines of the
    cluster's network as strangers: it listens on the address its peers use only; node2, with
    the run's token even, is closed unheard; 300 idle connections from node1's address get no
    thread each (all but a few closed as accepted, the few after seconds, none answered, the
    interpreter's switch interval untouched); the sender's replica then arrives as ever."""
    mine, theirs = _node(tmp_path / "n1"), _node(tmp_path / "n2")
    folder = _commit(mine, Key(OWN, 0, 1, 2), 4)
    peer, stranger = socket.gethostbyname("node1"), socket.gethostbyname("node2")
    here = address_toward(peer)  # this machine's address on the cluster's network
    receiver = replica.Receiver(theirs, TOKEN, here, timeout_s=600, senders=[peer])
    port = receiver.address[1]
    most = 1 + replica.SPARE  # connections served at once
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=30)
        out, _ = _netns("node2", _SEND, here, port, folder, TOKEN, stranger).communicate(
            timeout=120
        )
        assert out.startswith("refused: "), out

        switch = sys.getswitchinterval()
        idle = _netns("node1", _IDLE, here, port, 300)
        said, closed = [], 0
        for line in iter(idle.stdout.readline, ""):
            said += [line] if line.startswith("said") else []
            closed = int(line.split()[1]) if line.startswith(("closed", "done")) else closed
            if closed >= 300 - most or line.startswith("done"):
                break
        assert closed >= 300 - most, said
        serving = [t for t in threading.enumerate() if t.name == "snapshot-replica"]
        assert len(serving) <= most and sys.getswitchinterval() == switch
        rest, _ = idle.communicate(timeout=120)
        assert rest.splitlines()[-1] == "done 300" and not said and "said" not in rest, rest

        out, _ = _netns("node1", _SEND, here, port, folder, TOKEN, peer).communicate(timeout=120)
        assert out == "sent\n", out
    finally:
        receiver.close()
    assert theirs.keys() == [Key(REPLICA, 0, 1, 2)]
    assert theirs.store(Key(REPLICA, 0, 1, 2)).steps() == [4]


# -- real runs -----------------------------------------------------------------------------------

NODES = ["node-a", "node-b"]
TASKS = {"PYTHONPATH": os.path.join(REPO, "tests")}  # testtasks
KILLED = {**TASKS, "CLUSTERFLOW_TEST_KILL_AT": "11", "CLUSTERFLOW_TEST_KILL_RANK": "1"}


def _overrides(run_dir, memory):
    return [
        f"run.dir={run_dir}",
        "task.target=testtasks:KillAtEnv",
        "checkpoint.memory_every_steps=3",
        f"checkpoint.memory_dir={memory}/{{node}}",
    ]


@contextlib.contextmanager
def _shared_memory(nodes=NODES):
    """A memory dir like a node's /dev/shm that every user of this machine reaches: a folder in
    /dev/shm (0755) holding one folder per node, 1777 (sticky: every user adds entries, none
    moves another's). pytest's own tmp folders are root's alone (0700), where another user could
    touch nothing whatever the run does."""
    root = tempfile.mkdtemp(prefix="clusterflow-test-", dir="/dev/shm")
    try:
        os.chmod(root, 0o755)
        for node in nodes:
            os.mkdir(os.path.join(root, node))
            os.chmod(os.path.join(root, node), 0o1777)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _as_nobody(*argv):
    """``argv`` run as another user of the node (nobody, no groups)."""
    return subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A 2-rank run on two "nodes" whose rank 1 was SIGKILLed in step 11 (epoch 2; the shared
    filesystem's newest checkpoint is step 8, the memory's newest snapshot set step 9), its
    memory in a /dev/shm-like folder (:func:`_shared_memory`)."""
    if os.geteuid() != 0:
        pytest.skip("a UTS namespace per rank needs root (CI runs as root)")
    d = str(tmp_path_factory.mktemp("killed") / "run")
    os.makedirs(d)
    # The run's folder key, drawn as its rank 0 would: the run reads it, the kill waits on paths.
    snapshots.folder_key(RunPaths(d).memory_key, create=True)
    with _shared_memory() as memory:
        # Both replicas of step 9 arrived before rank 1 dies (each test reads one of them).
        replicas = [
            _snapshot(memory, d, node, f"replica-a0-r{rank}-w2", 9, MANIFEST)
            for node, rank in (("node-b", 0), ("node-a", 1))
        ]
        env = {**KILLED, "CLUSTERFLOW_TEST_KILL_AFTER": os.pathsep.join(replicas)}
        codes = launch.run(2, "configs/tiny.yaml", _overrides(d, memory), d, env=env, nodes=NODES)
        assert codes[1] == -signal.SIGKILL, codes
        yield d, memory


def _folder(memory, d, node):
    """The run ``d``'s folder in ``node``'s memory."""
    return snapshots.run_folder(
        f"{memory}/{{node}}", d, node, snapshots.folder_key(RunPaths(d).memory_key)
    )


def _copy(killed, tmp_path, memory=None, nodes=NODES):
    """The killed run dir and its ``nodes``' memory, copied to ``tmp_path`` (and ``memory``; the
    memory folder is named after the run dir's path, so the copy's is renamed)."""
    d, memory = str(tmp_path / "run"), memory or str(tmp_path / "memory")
    shutil.copytree(killed[0], d, symlinks=True)
    for node in nodes:
        shutil.copytree(_folder(killed[1], killed[0], node), _folder(memory, d, node))
    return d, memory


def _resume(d, memory):
    codes = launch.run(2, "configs/tiny.yaml", _overrides(d, memory), d, env=TASKS, nodes=NODES)
    assert codes == [0, 0], open(os.path.join(d, "logs", "rank0.attempt1.log")).read()
    return open(os.path.join(d, "logs", "rank0.attempt1.log")).read()


def _status(d):
    """``status --json``'s record of a local run (no Slurm queue to ask)."""
    return collect(RunPaths(d), queue_state=lambda job_id: None)


def _said(log, *words):
    return [line.split(": ", 1)[1] for line in log.splitlines() if all(w in line for w in words)]


def _snapshot(memory, d, node, key, step, name):
    return os.path.join(_folder(memory, d, node), key, f"step-{step}", name)


@pytest.mark.slow
def test_a_killed_rank_resumes_from_its_nodes_memory(killed, tiny_two_rank_run, tmp_path):
    d, memory = _copy(killed, tmp_path)
    log = _resume(d, memory)
    assert _said(log, "resumed from") == [
        "resumed from the memory of node-a, node-b (step 9): epoch 2, step 3 of the epoch, "
        + "global step 9"
    ]
    assert weights_equal(os.path.join(d, "model.pt"), os.path.join(tiny_two_rank_run, "model.pt"))
    assert _status(d)["restored_from"] == [None, "memory"]
    # The run completed: its snapshots leave the nodes' memory.
    for node in NODES:
        assert not os.path.exists(_folder(memory, d, node))


def _plant(killed, folder, staging):
    """As another user: make ``folder`` first (0777) and commit in it what node-a held, rank 0's
    own snapshot of step 9 with other weights, its manifest and digests valid (written through
    the store, as the run writes one)."""
    genuine = NodeSnapshots(_folder(killed[1], killed[0], "node-a"), PACKED, identity.check)
    own = Key(OWN, 0, 0, 2)
    ckpt = genuine.verify(own, 9)
    for t in ckpt.objects[MODEL].values():
        if t.is_floating_point():
            t.add_(1.0)
    meta = {k: v for k, v in ckpt.manifest.items() if k not in _OWN}
    CheckpointStore(
        os.path.join(staging, own.name), keep_last=2, fsync=False, codec=PACKED, readable=False
    ).save(9, ckpt.objects, meta)
    shutil.copytree(os.path.join(genuine.folder, "replica-a0-r1-w2"), f"{staging}/replica-a0-r1-w2")
    subprocess.run(["chmod", "-R", "a+rX", staging], check=True)
    out = _as_nobody(
        "sh",
        "-c",
        f"mkdir -m 0777 {folder} && cp -r {staging}/. {folder}/ && chmod -R a+rwX {folder}",
    )
    assert out.returncode == 0, out.stderr
    return sorted(os.listdir(folder))


@pytest.mark.slow
def test_a_folder_another_user_made_is_never_read(killed, tiny_two_rank_run, tmp_path):
    """Node-a's memory folder for the run was made first by another user (0777), who committed a
    snapshot of rank 0 with other weights in it (valid manifest and digests): it is never read
    or written, one line says so, and the resume reads rank 0's replica on node-b instead, with
    the shared filesystem's newest checkpoint damaged too (a restore that read it would say so):
    bitwise the uninterrupted run."""
    with _shared_memory() as memory:
        d, memory = _copy(killed, tmp_path, memory, nodes=["node-b"])
        folder = _folder(memory, d, "node-a")
        planted = _plant(killed, folder, f"{memory}/staging")  # where another user reads it
        with open(os.path.join(d, "checkpoints", "step-8", "model.pt"), "r+b") as f:
            f.truncate(100)
        log = _resume(d, memory)
        assert weights_equal(
            os.path.join(d, "model.pt"), os.path.join(tiny_two_rank_run, "model.pt")
        )
        assert sorted(os.listdir(folder)) == planted  # nothing written there, nothing removed
    assert _said(log, "snapshots in memory off") == [
        f"snapshots in memory off on node-a for this attempt: {folder} belongs to user nobody "
        + "(uid 65534), not to this job's user root (uid 0); no snapshot or replica is kept there "
        + "(a restart reads the other nodes' copies or the shared filesystem); remove it, or set "
        + "checkpoint.memory_dir to a folder of your own"
    ]
    assert _said(log, "resumed from") == [
        "resumed from the replica on node-b (rank 0) and memory of node-b (rank 1) (step 9): "
        + "epoch 2, step 3 of the epoch, global step 9"
    ]
    assert not _said(log, "damaged checkpoint") and not _said(log, " is damaged (")
    assert _status(d)["restored_from"] == [None, "replica"]


def test_snapshots_and_replicas_are_the_users_alone(killed):
    """Every folder the run made in the nodes' memory is 0700, every file 0600 (the replicas
    the receiver wrote too), all the user's: another user of the node lists none of them and
    reads none, though the memory dir is open to every user (like /dev/shm)."""
    d, memory = killed
    for node in NODES:
        folder = _folder(memory, d, node)
        kinds = set()
        for top, dirs, files in os.walk(folder):
            kinds.update(n.split("-")[0] for n in dirs if top == folder)
            for path, mode in [(top, 0o700)] + [(os.path.join(top, f), 0o600) for f in files]:
                st = os.lstat(path)
                assert (stat.S_IMODE(st.st_mode), st.st_uid) == (mode, os.geteuid()), path
        assert kinds == {"own", "replica"}
        manifest = _snapshot(memory, d, node, f"own-a0-r{NODES.index(node)}-w2", 9, MANIFEST)
        for argv in (["ls", folder], ["cat", manifest], ["ls", os.path.dirname(manifest)]):
            out = _as_nobody(*argv)
            assert out.returncode != 0 and "Permission denied" in out.stderr, (argv, out)
    assert _as_nobody("ls", f"{memory}/node-a").returncode == 0  # the memory dir itself is open


@pytest.mark.slow
def test_damaged_snapshots_fall_back_one_copy_then_one_tier(killed, tiny_two_rank_run, tmp_path):
    """Rank 0's own snapshot truncated: its replica on node-b is read instead. Then, in a copy
    of the same run, rank 0's replica bit-flipped too: no sound copy of rank 0 is left, and the
    run resumes from the shared filesystem. One line each, naming the copy and why."""
    d, memory = _copy(killed, tmp_path / "one")
    own = _snapshot(memory, d, "node-a", "own-a0-r0-w2", 9, "model.pt")
    size = os.path.getsize(own)
    with open(own, "r+b") as f:
        f.truncate(size - 7)
    log = _resume(d, memory)
    assert _said(log, " is damaged (") == [
        "snapshot of rank 0 at step 9 in the memory of node-a is damaged (model.pt has "
        + f"{size - 7} bytes, the manifest says {size}); trying the replica on node-b"
    ]
    assert _said(log, "resumed from") == [
        "resumed from the replica on node-b (rank 0) and memory of node-b (rank 1) (step 9): "
        + "epoch 2, step 3 of the epoch, global step 9"
    ]
    assert weights_equal(os.path.join(d, "model.pt"), os.path.join(tiny_two_rank_run, "model.pt"))

    d, memory = _copy(killed, tmp_path / "two")
    with open(_snapshot(memory, d, "node-a", "own-a0-r0-w2", 9, "model.pt"), "r+b") as f:
        f.truncate(100)
    theirs = _snapshot(memory, d, "node-b", "replica-a0-r0-w2", 9, "train_state.pt")
    with open(theirs, "r+b") as f:
        f.seek(os.path.getsize(theirs) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    log = _resume(d, memory)
    assert [line.split(" is damaged (")[0] for line in _said(log, " is damaged (")] == [
        "snapshot of rank 0 at step 9 in the memory of node-a",
        "snapshot of rank 0 at step 9 in the replica on node-b",
    ]
    assert _said(log, " is damaged (")[1].endswith(
        "(train_state.pt does not match its blake3 digest (bit rot or a partial write)); "
        "falling back to the shared filesystem"
    )
    assert _said(log, "resumed from") == [
        f"resumed from {d}/checkpoints/step-8: epoch 2, step 2 of the epoch, global step 8"
    ]
    assert weights_equal(os.path.join(d, "model.pt"), os.path.join(tiny_two_rank_run, "model.pt"))
    assert _status(d)["restored_from"] == [None, "shared"]
