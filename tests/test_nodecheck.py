"""The check of a node before a restart inside the job uses it (job/nodecheck.py): the run dir and
the memory folder writable, the rendezvous port free, the GPUs visible; the driver reads one line
per node. On the real cluster: tests/test_slurm_restarts.py."""

import json
import os
import socket
import subprocess
import sys

from conftest import REPO

from clusterflow.job import nodecheck


def test_a_fit_node_has_no_problem_and_leaves_nothing_behind(tmp_path):
    run, memory = tmp_path / "run", tmp_path / "shm"
    run.mkdir()
    memory.mkdir()
    probe = str(run / ".nodecheck-{node}")
    found = nodecheck.problems("node1", probe, memory=[str(memory / "{node}" / "run-x")], gpus=0)
    assert found == []
    assert os.listdir(run) == [] and os.listdir(memory) == []  # probes removed


def test_an_unusable_run_dir_or_memory_folder_is_named(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a folder should be")
    found = nodecheck.problems(
        "node2", str(blocked / ".nodecheck-{node}"), memory=[str(blocked / "{node}" / "run-x")]
    )
    assert found[0].startswith(f"the run dir is not writable from here ({blocked}: "), found
    assert found[1] == (
        f"the memory folder {blocked}/node2/run-x is not usable: {blocked} is not a folder"
    ), found


def test_a_port_held_by_a_process_is_named_on_the_node_that_hosts_the_rendezvous(tmp_path):
    held = socket.socket()
    held.bind(("", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        probe = str(tmp_path / ".nodecheck-{node}")
        assert nodecheck.problems("node1", probe, port_on="node1", port=port) == [
            f"the rendezvous port {port} is in use here (a process left holding it)"
        ]
        assert nodecheck.problems("node2", probe, port_on="node1", port=port) == []
    finally:
        held.close()
    assert nodecheck.problems("node1", probe, port_on="node1", port=port) == []


def test_gpus_are_counted_where_the_config_expects_them(tmp_path):
    probe = str(tmp_path / ".nodecheck-{node}")
    two = ["0000:17:00.0", "0000:65:00.0"]
    assert nodecheck.problems("n", probe, gpus=2, listed=lambda: two) == []
    assert nodecheck.problems("n", probe, gpus=4, listed=lambda: two) == [
        "2 GPU(s) visible here, cluster.gpus_per_node expects 4"
    ]

    def gone():
        raise FileNotFoundError(nodecheck.NVIDIA_GPUS)

    assert nodecheck.problems("n", probe, gpus=1, listed=gone) == [
        "0 GPU(s) visible here, cluster.gpus_per_node expects 1"
    ]


def test_the_driver_reads_one_line_per_node_and_names_those_without_one():
    output = "\n".join(
        [
            json.dumps({"node": "node1", "problems": []}),
            "srun: error: something srun says",
            json.dumps({"node": "node3", "problems": ["a", "b"]}),
        ]
    )
    assert nodecheck.verdicts(["node1", "node2", "node3"], output, answered=True) == {
        "node2": "its node check ended without an answer (srun could not start it there)",
        "node3": "a; b",
    }
    assert nodecheck.verdicts(["node2"], "", answered=False) == {
        "node2": "it did not answer the node check in time (a hung or lost node)"
    }


def test_the_check_runs_as_a_program_and_prints_its_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable, "-m", "clusterflow.job.nodecheck", "--probe",
            str(tmp_path / ".nodecheck-{node}"), "--memory", str(tmp_path / "missing" / "{node}"),
        ],
        cwd=REPO, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"node": nodecheck.node_name(), "problems": []}
