import subprocess
import sys

import pytest

from clusterflow.distributed import DistEnv, derive_port, free_port, parse_nodelist
from clusterflow.distributed.env import PORT_HIGH, PORT_LOW
from clusterflow.errors import UserError

SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "1234",
    "SLURM_RESTART_COUNT": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)",
}


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-3],b1", ["a1", "a2", "a3", "b1"]),
        ("rack1-[1-2]-gpu[3-4]", ["rack1-1-gpu3", "rack1-1-gpu4", "rack1-2-gpu3", "rack1-2-gpu4"]),
        ("node1", ["node1"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("x[098-101]", ["x098", "x099", "x100", "x101"]),
    ],
)
def test_nodelist(text, hosts):
    assert parse_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node[3-1]", "a,,b", "n[a-b]", "n]1[", "", "n[[1]]"])
def test_bad_nodelist(text):
    with pytest.raises(UserError, match="nodelist|NODELIST"):
        parse_nodelist(text)


CASES = [
    ("nothing", {}, {"rank": 0, "world_size": 1, "source": "single"}),
    (
        "slurm",
        SLURM,
        {
            "rank": 3,
            "world_size": 4,
            "local_rank": 1,
            "local_world_size": 2,
            "node_rank": 1,
            "num_nodes": 2,
            "master_addr": "gpu07",
            "master_port": derive_port("1234", 2),
            "job_id": "1234",
            "attempt": 2,
            "hosts": ("gpu07", "gpu08"),
            "source": "slurm",
        },
    ),
    ("slurm port override", {**SLURM, "MASTER_PORT": "29999"}, {"master_port": 29999}),
    (
        "torchrun",
        {
            "RANK": "1",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1234",
        },
        {"rank": 1, "world_size": 2, "master_addr": "h", "master_port": 1234, "source": "torchrun"},
    ),
    (
        "torchrun inside slurm wins",
        {
            **SLURM,
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "gpu07",
            "MASTER_PORT": "5",
        },
        {"world_size": 8, "source": "torchrun", "num_nodes": 2},
    ),
    (
        "submitit local",
        {
            "SUBMITIT_LOCAL_GLOBALID": "1",
            "SUBMITIT_LOCAL_LOCALID": "1",
            "SUBMITIT_LOCAL_NTASKS": "2",
            "SUBMITIT_LOCAL_JOB_ID": "77",
            "MASTER_PORT": "4000",
        },
        {
            "rank": 1,
            "world_size": 2,
            "local_rank": 1,
            "master_port": 4000,
            "source": "submitit-local",
            "job_id": "77",
        },
    ),
]


@pytest.mark.parametrize("name,env,expected", CASES, ids=[c[0] for c in CASES])
def test_from_env(name, env, expected):
    got = DistEnv.from_env(env)
    for k, v in expected.items():
        assert getattr(got, k) == v, (k, getattr(got, k), v)


BAD = [
    (
        "slurm missing ntasks",
        {k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"},
        "SLURM_NTASKS not set",
    ),
    (
        "slurm procid too big",
        {**SLURM, "SLURM_PROCID": "4"},
        "SLURM_PROCID=4 must be below SLURM_NTASKS=4",
    ),
    ("slurm nodelist size", {**SLURM, "SLURM_JOB_NODELIST": "gpu07"}, "names 1 hosts"),
    ("slurm not int", {**SLURM, "SLURM_NTASKS": "four"}, "SLURM_NTASKS='four'"),
    (
        "slurm no nodelist",
        {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"},
        "SLURM_JOB_NODELIST not set",
    ),
    ("torchrun partial", {"RANK": "0"}, "LOCAL_RANK, WORLD_SIZE not set"),
    (
        "torchrun rank",
        {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},
        "RANK=2 must be below WORLD_SIZE=2",
    ),
    (
        "torchrun no master",
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"},
        "without MASTER_ADDR",
    ),
]


@pytest.mark.parametrize("name,env,needle", BAD, ids=[b[0] for b in BAD])
def test_inconsistent_env_names_variables(name, env, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        DistEnv.from_env(env)


def test_port_depends_on_job_and_attempt():
    assert derive_port("1", 0) == derive_port("1", 0)
    assert derive_port("1", 0) != derive_port("1", 1)
    ports = [derive_port(str(j), a) for j in range(50) for a in range(3)]
    # below Linux's range of ports for connections (32768-60999 by default), which any socket
    # could take before the master binds
    assert all(PORT_LOW <= p < PORT_HIGH <= 32768 for p in ports), ports


def test_a_free_port_is_chosen_below_the_connection_range():
    ports = {free_port() for _ in range(20)}
    assert all(PORT_LOW <= p < PORT_HIGH for p in ports), ports
    assert len(ports) > 1, ports  # chosen at random: two local runs rarely meet


def test_slurm_limit_on_hosts_is_enforced_before_expanding():
    """A range of more hosts than Slurm allows is refused at once, naming the value and the limit
    (run under a 1 GiB address-space cap: expanding 100 million names would need far more)."""
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from clusterflow.distributed import parse_nodelist\n"
        "parse_nodelist('n[0-100000000]')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1 and "MemoryError" not in out.stderr, out.stderr[-2000:]
    assert (
        "UserError: Slurm nodelist 'n[0-100000000]': range '0-100000000' has 100000001 hosts, over "
        "Slurm's limit of 65536 hosts" in out.stderr
    )
    assert len(parse_nodelist("n[1-65536]")) == 65536
    for text in ("n[0-65536]", "n[1-300]-[1-300]", "a[1-40000],b[1-40000]"):
        with pytest.raises(UserError, match="over Slurm's limit of 65536 hosts"):
            parse_nodelist(text)
