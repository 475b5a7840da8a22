"""GPU selection on a workstation and the NVML helpers: pure functions over snapshots, no GPU
needed."""

import os

import pytest
from conftest import REPO

from clusterflow import config
from clusterflow.errors import UserError
from clusterflow.launch.gpus import Need, classify, for_local, select_gpus
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
    assert sel.indices == (0, 2, 3, 1)  # all usable; the most free memory first


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


# -- the run's need, and the GPUs that fit it ------------------------------------------------------

GIB = 2**30
NEED = Need(
    {
        "parameters": 2 * GIB,
        "gradients": 2 * GIB,
        "optimizer state": 4 * GIB,
        "activations of one batch": 6 * GIB,
    }
)
ROOMY = [
    gpu(0, used=60000),  # used by a process we cannot see
    gpu(1, used=400, total=24576),  # 23.6 GiB free
    gpu(2, used=300),  # 79.4 GiB free
    gpu(3, used=900, total=16000),  # 14.7 GiB free: less than the need, 15 GiB
]


def test_the_need_is_said_with_its_parts():
    assert NEED.total_mb == 15 * 1024
    assert NEED.line() == (
        "the run needs about 15.0 GiB per GPU (parameters 2.0 GiB, gradients 2.0 GiB, "
        "optimizer state 4.0 GiB, activations of one batch 6.0 GiB, CUDA context 1.0 GiB)"
    )


def test_auto_and_a_count_take_the_gpus_with_the_most_free_memory_that_fit():
    sel = select_gpus(ROOMY, 2, "auto", need=NEED)
    assert sel.indices == (2, 1)  # 79.4 GiB free, then 23.6 GiB
    assert sel.reasons[3] == "too little memory: 14.7 GiB free, 15.0 GiB needed"
    assert sel.summary().splitlines()[1] == "  " + NEED.line()
    assert select_gpus(ROOMY, 1, 1, need=NEED).indices == (2,)


def test_no_gpu_fits_the_need_is_one_line_with_the_parts():
    small = [gpu(0, total=16000, used=900), gpu(1, used=31020, procs=[(4242, "python", 30720)])]
    with pytest.raises(UserError) as err:
        select_gpus(small, 1, 1, need=NEED)
    said = str(err.value)
    assert "\n" not in said
    assert said.startswith("cluster.gpus=1 but only 0 of 2 GPUs are free (none): GPU 0 too little")
    assert "GPU 1 busy: held by pid 4242 (python, 30.0 GiB)" in said
    assert "(the run needs about 15.0 GiB per GPU (parameters 2.0 GiB," in said
    with pytest.raises(UserError, match=r"GPU 0 is too little memory: .*\(the run needs about"):
        select_gpus(small, 1, [0], need=NEED)


@pytest.mark.parametrize(
    "overrides,gpus,per_node,tasks",
    [
        (["cluster.gpus=2"], 2, 2, 2),
        (["cluster.gpus=2", "cluster.gpus_per_node=2"], 2, 2, 2),
        (["cluster.gpus=[2]", "cluster.gpus_per_node=1"], [2], 1, 1),
        (["cluster.gpus=0,2", "cluster.gpus_per_node=2"], [0, 2], 2, 2),
        (["cluster.gpus=auto"], "auto", 0, 1),
    ],
)
def test_cluster_gpus_is_auto_a_count_or_a_list(overrides, gpus, per_node, tasks):
    c = config.load(None, overrides).cluster
    assert (c.gpus, c.gpus_per_node, c.tasks_per_node) == (gpus, per_node, tasks)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["cluster.gpus=0"], "cluster.gpus = 0: a count of GPUs must be >= 1"),
        (
            ["cluster.gpus=2", "cluster.gpus_per_node=4"],
            "cluster.gpus = 2: asks for 2 GPU(s) but cluster.gpus_per_node=4; set one of them",
        ),
    ],
)
def test_a_count_that_does_not_fit_is_refused(overrides, message):
    with pytest.raises(UserError) as err:
        config.load(None, overrides)
    assert message in str(err.value)


def test_the_estimate_counts_parameters_gradients_optimizer_and_activations(monkeypatch):
    """A model known by hand (testtasks:MemoryProbe: 64 -> 256 -> 8): parameters exactly, the
    optimizer's moments per parameter, and activations that grow with the batch."""
    from clusterflow.train import memory_estimate

    monkeypatch.syspath_prepend(os.path.join(REPO, "tests"))
    probe = ["task.target=testtasks:MemoryProbe", "cluster.tasks_per_node=2"]
    params = (64 * 256 + 256 + 256 * 8 + 8) * 4
    adamw = memory_estimate.estimate(
        config.load(None, [*probe, "train.batch_size=8", "train.amp=none"])
    )
    assert adamw["parameters"] == adamw["gradients"] == params
    assert adamw["optimizer state"] == 2 * params
    # Autograd keeps, per sample, at least the input (64) and the hidden layer (256) in fp32.
    assert 4 * (64 + 256) * 4 <= adamw["activations of one batch"] <= 4 * (64 + 2 * 256 + 8) * 4
    sgd = memory_estimate.estimate(
        config.load(None, [*probe, "train.optimizer=sgd", "train.amp=none"])
    )
    assert sgd["optimizer state"] == params
    big = memory_estimate.estimate(
        config.load(None, [*probe, "train.batch_size=64", "train.amp=none"])
    )
    assert big["activations of one batch"] == 8 * adamw["activations of one batch"]
    bf16 = memory_estimate.estimate(
        config.load(None, [*probe, "train.batch_size=64", "train.amp=bf16"])
    )
    assert 2 * bf16["activations of one batch"] == big["activations of one batch"]


def test_submit_local_refuses_in_one_line_when_no_gpu_fits(tmp_path, monkeypatch, capsys):
    """NVML replaced at its boundary (nvml.read_snapshot): two GPUs, one busy, one too small
    for the run's estimated need. submit --local says so in one line, with the need's parts, and
    writes nothing."""
    from clusterflow.launch import submit

    monkeypatch.syspath_prepend(os.path.join(REPO, "tests"))
    asked = []

    def need(cfg):
        asked.append(cfg.task.target)
        return NEED

    monkeypatch.setattr(
        nvml,
        "read_snapshot",
        lambda: [gpu(0, total=16000, used=900), gpu(1, used=31020, procs=[(4242, "py", 30720)])],
    )
    monkeypatch.setattr(submit.jobs, "memory_need", need)
    run_dir = tmp_path / "run"
    argv = ["configs/tiny.yaml", "--local", f"run.dir={run_dir}", "cluster.gpus=2"]
    with pytest.raises(SystemExit) as stop:
        submit.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: cluster.gpus=2 but only 0 of 2 GPUs are free (none)")
    assert "the run needs about 15.0 GiB per GPU" in err and asked
    assert not run_dir.exists()
    monkeypatch.setattr(nvml, "read_snapshot", lambda: None)
    asked.clear()
    with pytest.raises(SystemExit):
        submit.main(argv)
    assert "NVML sees none" in capsys.readouterr().err
    assert not asked  # no GPU: the model is never built for an estimate


def test_a_script_run_is_not_estimated_as_the_default_task(monkeypatch, capsys):
    """`submit --script train.py --local` on GPUs: the script's model is its own, unknown before
    it runs, so no need is estimated (config.yaml's task.target is then only the default task,
    which the script never trains) and the GPUs are taken by free memory alone."""
    from clusterflow.launch import jobs
    from clusterflow.rundir import saved_config

    script = os.path.join(REPO, "examples", "ddp_classifier.py")
    cfg = saved_config.load_command(None, ["cluster.gpus=1"], script, [])
    assert jobs.memory_need(cfg) is None
    monkeypatch.setattr(nvml, "read_snapshot", lambda: [gpu(0, used=900), gpu(1, used=300)])
    chosen = for_local(1, 1, {}, need=lambda: jobs.memory_need(cfg))
    said = capsys.readouterr().out
    assert chosen == [1] and "the run needs" not in said, said
