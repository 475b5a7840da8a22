"""Which failures are a node's, and whether one requeues the job without that node: the pure
parts of job/node_fault.py as tables (the requeue itself runs on the real Slurm cluster in
tests/test_slurm_node_exclusion.py)."""

import pytest

from clusterflow import rundir
from clusterflow.config.job_config import from_dict
from clusterflow.errors import UserError
from clusterflow.job.node_fault import Facts, Plan, device_error, plan


@pytest.mark.parametrize(
    "message, kind",
    [
        ("CUDA error: uncorrectable ECC error encountered", "a CUDA device error"),
        ("RuntimeError: CUDA error: unspecified launch failure", "a CUDA device error"),
        ("CUDA error: CUDA-capable device(s) is/are busy or unavailable", "a CUDA device error"),
        (
            "RuntimeError: No CUDA GPUs are available; no CUDA-capable device is detected",
            "a CUDA device error",
        ),
        (
            (
                "Unable to determine the device handle for GPU 0000:3B:00.0: GPU has fallen off "
                "the bus"
            ),
            "a CUDA device error",
        ),
        ("CUDA error: unknown error", "a CUDA device error"),
        (
            (
                "NCCL error in: ProcessGroupNCCL.cpp:1275, unhandled cuda error (run with "
                "NCCL_DEBUG=INFO for details), NCCL version 2.21.5"
            ),
            "an NCCL error",
        ),
        (
            "DistBackendError: NCCL error ... unhandled system error (run with NCCL_DEBUG=INFO)",
            "an NCCL error",
        ),
        (
            "NCCL error in: ProcessGroupNCCL.cpp:3356, internal error - please report this issue",
            "an NCCL error",
        ),
        (
            "ncclSystemError: System call (e.g. socket, malloc) or external library call failed",
            "an NCCL error",
        ),
        # the code's or the batch size's, or a peer's: not this node's
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", None),
        ("CUDA error: device-side assert triggered", None),
        ("CUDA error: an illegal memory access was encountered", None),
        ("NCCL error ... remote process exited or there was a network error", None),
        ("NCCL error in: ProcessGroupNCCL.cpp:1275, invalid usage", None),
        (
            "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)",
            None,
        ),
        ("ValueError: deliberate failure in the test task", None),
    ],
)
def test_device_errors_are_told_from_the_codes_own(message, kind):
    assert device_error(message) == kind


FACTS = Facts(
    interactive=False,
    has_scontrol=True,
    failures=0,
    excluded=(),
    requested=(),
    partition=("node1", "node2", "node3"),
    nodes_needed=2,
)


def with_(**changes):
    return Facts(**{**FACTS.__dict__, **changes})


@pytest.mark.parametrize(
    "facts, expected",
    [
        (FACTS, Plan(True, ("node1",))),
        # the job's excluded nodes grow; a node excluded already stays
        (
            with_(excluded=("node3",), partition=("node1", "node2", "node3", "node4")),
            Plan(True, ("node1", "node3")),
        ),
        (with_(excluded=("node1",), partition=None), Plan(True, ("node1",))),
        (with_(failures=2), Plan(True, ("node1",))),
        (with_(partition=None, nodes_needed=64), Plan(True, ("node1",))),
    ],
)
def test_a_node_fault_requeues_with_the_node_added_to_the_excluded_ones(facts, expected):
    assert plan("node1", facts, limit=3) == expected


@pytest.mark.parametrize(
    "facts, why",
    [
        (with_(interactive=True), "an interactive allocation (salloc) is not requeued by Slurm"),
        (with_(has_scontrol=False), "scontrol is not in this job's PATH"),
        (
            with_(failures=3),
            "already requeued 3 time(s) after a node failure (cluster.max_node_failures=3)",
        ),
        (
            with_(requested=("node1", "node2")),
            "node1 is one of the nodes the job asked for by name",
        ),
        (
            with_(partition=("node1", "node2")),
            "leaving out node1 would leave 1 node(s) of the partition for a job of 2",
        ),
        (with_(excluded=("node3",)), "leaving out node1, node3 would leave 1 node(s)"),
    ],
)
def test_a_node_fault_that_cannot_leave_its_node_out_is_not_requeued(facts, why):
    p = plan("node1", facts, limit=3)
    assert not p.requeue and why in p.why, p


def test_excluded_nodes_are_those_slurm_took(tmp_path):
    paths = rundir.RunPaths(str(tmp_path))
    rundir.record_stop(paths, reason="timeout", job_id="7")
    rundir.record_stop(paths, reason=rundir.NODE_FAILURE, node="node2", excluded=True)
    rundir.record_stop(paths, reason=rundir.NODE_FAILURE, node="node5", excluded=False)
    rundir.record_stop(paths, reason=rundir.NODE_FAILURE, node="node1", excluded=True)
    assert rundir.excluded_nodes(paths) == ["node1", "node2"]
    assert rundir.count_stops(paths, rundir.NODE_FAILURE) == 3


def test_max_node_failures_is_checked():
    assert from_dict({"cluster": {"max_node_failures": 0}}).cluster.max_node_failures == 0
    with pytest.raises(UserError, match=r"cluster.max_node_failures.*-1.*must be >= 0"):
        from_dict({"cluster": {"max_node_failures": -1}})
