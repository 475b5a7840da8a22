"""GPU selection on a workstation and the NVML helpers: pure functions over snapshots, no GPU
needed."""

import os

import pytest

from clusterflow.errors import UserError
from clusterflow.launch.gpus import classify, select_gpus
from clusterflow.observe import nvml


def gpu(index, used=300, total=81559, procs=(), util=0):
    return {
        "index": index,
        "uuid": f"GPU-{index}{index}{index}{index}-aaaa",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_total_mb": total,
        "memory_used_mb": used,
        "util_pct": util,
        "temp_c": 35,
        "processes": [{"pid": pid, "name": name, "used_mb": mb} for pid, name, mb in procs],
    }


FREE = [gpu(0), gpu(1), gpu(2), gpu(3)]
BUSY1 = [gpu(0), gpu(1, used=31020, procs=[(4242, "python", 30720)], util=99), gpu(2), gpu(3)]
PARTLY = [
    gpu(0, used=12588, procs=[(777, "jupyter", 12288)]),
    gpu(1),
]  # busy, though 68 GiB are still free
HIDDEN = [gpu(0, used=20480), gpu(1)]  # memory used by a process we cannot see (another container)
SMALL = [gpu(0, total=2048, used=300), gpu(1)]  # a small display card
MIXED = [
    gpu(0, used=31020, procs=[(4242, "python", 30720)]),
    gpu(1, used=20480),
    gpu(2, total=2048),
    gpu(3),
]


@pytest.mark.parametrize(
    "snapshot,want,asked,chosen",
    [
        (FREE, 2, "auto", (0, 1)),
        (FREE, 4, "auto", (0, 1, 2, 3)),
        (BUSY1, 2, "auto", (0, 2)),
        (BUSY1, 3, "auto", (0, 2, 3)),
        (PARTLY, 1, "auto", (1,)),
        (HIDDEN, 1, "auto", (1,)),
        (SMALL, 1, "auto", (1,)),
        (MIXED, 1, "auto", (3,)),
        (FREE, 2, [2, 0], (2, 0)),  # explicit order is local-rank order
        (BUSY1, 2, [0, 3], (0, 3)),
    ],
)
def test_chosen(snapshot, want, asked, chosen):
    sel = select_gpus(snapshot, want, asked)
    assert sel.indices == chosen
    assert sel.uuids == tuple(f"GPU-{i}{i}{i}{i}-aaaa" for i in chosen)
    assert set(sel.reasons) == {g["index"] for g in snapshot}


@pytest.mark.parametrize(
    "snapshot,want,asked,message",
    [
        (
            BUSY1,
            2,
            [0, 1],
            (
                "cluster.gpus=[0, 1]: GPU 1 is busy: held by pid 4242 (python, 30.0 GiB); pick a "
                "free one (2, 3), use cluster.gpus=auto, or wait for or stop that process"
            ),
        ),
        (
            MIXED,
            2,
            "auto",
            (
                "cluster.gpus_per_node=2 but only 1 of 4 GPUs are free (3): GPU 0 busy: held by "
                "pid 4242 (python, 30.0 GiB); GPU 1 in use: 20.0 GiB used by a process not "
                "visible here (another container or user?); GPU 2 too little memory: 1.7 GiB "
                "free, 2.0 GiB needed; lower cluster.gpus_per_node to 1, wait for or stop the "
                "processes holding them, or name GPUs with cluster.gpus=[...]"
            ),
        ),
        (
            [
                gpu(
                    0,
                    used=31020,
                    procs=[(1, "a", 1024), (2, "b", 1024), (3, "c", None), (4, "d", 1024)],
                )
            ],
            1,
            "auto",
            (
                "cluster.gpus_per_node=1 but only 0 of 1 GPUs are free (none): GPU 0 busy: held "
                "by pid 1 (a, 1.0 GiB), pid 2 (b, 1.0 GiB), pid 3 (c) and 1 more; wait for or "
                "stop the processes holding them, or name GPUs with cluster.gpus=[...]"
            ),
        ),
        (FREE, 5, "auto", "cluster.gpus_per_node=5 but only 4 of 4 GPUs are free (0, 1, 2, 3)"),
        (
            FREE,
            2,
            [0, 7],
            (
                "cluster.gpus=[0, 7]: no GPU 7 on this machine; it has 0, 1, 2, 3 (as nvidia-smi "
                "numbers them)"
            ),
        ),
        (
            FREE,
            2,
            [0],
            "cluster.gpus=[0] names 1 GPU(s) but cluster.gpus_per_node=2; make them agree",
        ),
        (FREE, 2, [1, 1], "must be 'auto' or a list of distinct GPU indices"),
        (FREE, 1, ["0"], "must be 'auto' or a list of distinct GPU indices"),
        (
            None,
            2,
            "auto",
            "cluster.gpus_per_node=2 asks for GPUs, but NVML sees none on this machine",
        ),
        ([], 1, [0], "set cluster.gpus_per_node=0 to run on CPU"),
    ],
)
def test_refused(snapshot, want, asked, message):
    with pytest.raises(UserError) as err:
        select_gpus(snapshot, want, asked)
    assert message in str(err.value)


def test_our_own_processes_do_not_make_a_gpu_busy():
    sel = select_gpus(BUSY1, 4, "auto", ignore_pids=[4242], idle_used_mb=40000)
    assert sel.indices == (0, 1, 2, 3)


def test_auto_stays_within_cuda_visible_devices():
    sel = select_gpus(FREE, 2, "auto", cuda_visible_devices="2,GPU-3333")
    assert sel.indices == (2, 3)
    assert sel.reasons[0] == "hidden by CUDA_VISIBLE_DEVICES=2,GPU-3333"
    with pytest.raises(UserError, match="only 1 of 4 GPUs are free"):
        select_gpus(BUSY1, 2, "auto", cuda_visible_devices="1,2")


def test_env_and_summary_say_which_and_why():
    sel = select_gpus(BUSY1, 2, "auto")
    assert sel.env_for(0) == {
        "CUDA_VISIBLE_DEVICES": "GPU-0000-aaaa",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    assert sel.env_for(1)["CUDA_VISIBLE_DEVICES"] == "GPU-2222-aaaa"
    assert sel.summary().splitlines() == [
        "using GPUs 0, 2 (one per process)",
        "  GPU 0: used, free: no process, 79.4 GiB of 79.6 GiB free, 0% busy",
        "  GPU 1: not used, busy: held by pid 4242 (python, 30.0 GiB)",
        "  GPU 2: used, free: no process, 79.4 GiB of 79.6 GiB free, 0% busy",
        "  GPU 3: not used, free: no process, 79.4 GiB of 79.6 GiB free, 0% busy",
    ]
    no_uuid = select_gpus([{k: v for k, v in gpu(0).items() if k != "uuid"}], 1)
    assert no_uuid.env_for(0)["CUDA_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize(
    "g,usable,why",
    [
        (gpu(0), True, "free: no process, 79.4 GiB of 79.6 GiB free, 0% busy"),
        (gpu(0, used=1024), True, "free: no process, 78.6 GiB of 79.6 GiB free, 0% busy"),
        (
            gpu(0, used=1025),
            False,
            "in use: 1.0 GiB used by a process not visible here (another container or user?)",
        ),
        (gpu(0, procs=[(9, "Xorg", 20)]), False, "busy: held by pid 9 (Xorg, 0.0 GiB)"),
        (gpu(0, total=2348, used=300), True, "free: no process, 2.0 GiB of 2.3 GiB free, 0% busy"),
        (gpu(0, total=2347, used=300), False, "too little memory: 2.0 GiB free, 2.0 GiB needed"),
    ],
)
def test_classify(g, usable, why):
    assert classify(g, min_free_mb=2048) == (usable, why)


# -- nvml helpers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "index,visible,expected",
    [
        (0, None, 0),
        (1, None, 1),
        (0, "3,5", 3),
        (1, "3,5", 5),
        (2, "3,5", None),
        (0, "GPU-8f1c2d3e-aaaa", "GPU-8f1c2d3e-aaaa"),
        (0, "MIG-4b1c-0001", "MIG-4b1c-0001"),
        (0, "", None),
        (0, " 2 , 4", 2),
        (0, "nonsense", None),
    ],
)
def test_nvml_id_for_torch_device(index, visible, expected):
    assert nvml.nvml_id_for_torch_device(index, visible) == expected


def test_find_gpu_by_index_or_uuid_prefix():
    assert nvml.find_gpu(FREE, 2)["index"] == 2
    assert nvml.find_gpu(FREE, "GPU-3333")["index"] == 3
    assert nvml.find_gpu(FREE, "GPU-9") is None and nvml.find_gpu(FREE, 9) is None
    assert nvml.find_gpu(None, 0) is None and nvml.find_gpu(FREE, None) is None


def test_gpu_fields_leave_out_what_nvml_could_not_read():
    assert nvml.gpu_fields(FREE[1]) == {
        "gpu_index": 1,
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "gpu_mem_used_mb": 300,
        "gpu_mem_total_mb": 81559,
        "gpu_util_pct": 0,
        "gpu_temp_c": 35,
    }
    mig = {
        "index": 0,
        "memory_total_mb": 9856,
        "memory_used_mb": 13,
    }  # a MIG slice: no utilisation, no temperature
    assert nvml.gpu_fields(mig) == {"gpu_index": 0, "gpu_mem_used_mb": 13, "gpu_mem_total_mb": 9856}
    assert nvml.gpu_fields(None) == {}


def test_process_name_of_this_process_and_of_one_that_does_not_exist():
    assert nvml.process_name(os.getpid()).startswith("python")
    assert nvml.process_name(2**22 + 12345) == "?"


def test_read_snapshot_without_a_gpu_is_none():
    """This machine has no NVIDIA driver; with or without nvidia-ml-py the reader answers None,
    never raises."""
    assert nvml.read_snapshot() is None
