"""The GPU proof: every figure a GPU machine should give, in one command, with a report.

    python benchmarks/gpu_proof.py --out /tmp/proof            # every figure
    python benchmarks/gpu_proof.py --out /tmp/proof --quick    # small sizes (the suite's test)
    python benchmarks/gpu_proof.py --out /tmp/p2 --only knn_exact,fsdp_over_share
    python benchmarks/gpu_proof.py --merge /tmp/p1/proof.json /tmp/p2/proof.json --out /tmp/p

On a GPU machine each figure is taken at its real size; on a machine without one the script runs
each figure's CPU equivalent at a small size and marks the GPU figure "not taken" with the reason,
so the code of every figure runs in the test suite and never rots. docs/benchmarks.md says what
each figure means, its goal, and how to run this on a GPU machine with the wheels it needs.

Figures, most valuable first (each in a child process of its own, with a time limit, so that a
crash, a hang or a CUDA error in one leaves the others standing):

    environment       GPU model and memory, driver, torch, CUDA, NCCL, the faiss build
    nccl_two_ranks    2 processes, NCCL all_reduce (on one GPU when there is one); gloo fallback
    bf16_resume_tiny  configs/tiny.yaml, train.amp=bf16: SIGKILL, resume, model.pt bitwise?
    knn_exact         exact k-NN (1.2M x 512, k=30 on a GPU) vs a bare torch matmul + topk
    loop_throughput   benchmarks/trainer.py: clusterflow's loop vs a bare DDP loop
    embed_throughput  benchmarks/embed.py: the mining embed vs a bare no_grad loop
    bf16_resume_demo  configs/demo.yaml, train.amp=bf16: SIGKILL, resume, model.pt bitwise?
    nvml_heartbeats   a run's heartbeat files carry its GPU's memory and utilisation
    fsdp_over_share   train.parallel=fsdp trains a model whose DDP replica does not fit a rank's
                      share of GPU memory (which DDP, given the same share, cannot)

``DIR/proof.json`` (every figure's values) and ``DIR/proof.md`` (one table) are rewritten after
each figure, so a run cut short still leaves what was taken. ``--budget-s`` stops starting
figures that could outlast it (a machine held for a fixed time: give it that time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
TESTS = os.path.join(REPO, "tests")
for _p in (REPO, BENCH):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import embed as bench_embed
import knn as bench_knn
import numpy as np
import sharded as bench_sharded
import torch
import trainer as bench_trainer

from clusterflow.distributed import free_port
from clusterflow.job import run as job_run
from clusterflow.mining import knn
from clusterflow.observe import nvml
from clusterflow.rundir import RunPaths
from clusterflow.tasks.images import ImageFolderTask
from clusterflow.tasks.pseudo_id import PseudoIDTask
from clusterflow.train.trainer import Trainer

GPU = torch.cuda.is_available()
NO_GPU = f"no CUDA device here (torch {torch.__version__}): its CPU equivalent ran at a small size"


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    goal: str
    limit_s: float  # on a GPU; the CPU equivalents are far smaller
    take: Callable[[bool], dict[str, Any]]  # quick -> the figure's result


# -- what every figure returns --------------------------------------------------------------------


def result(
    values: dict[str, Any], summary: str, met: bool | None, gpu_taken: bool, reason: str = ""
) -> dict[str, Any]:
    """One figure's result: ``gpu`` is "taken" or "not taken: why"; ``where`` says on what it ran
    (the GPU, or the CPU equivalent)."""
    where = (
        f"GPU: {torch.cuda.get_device_name(0)}"
        if GPU
        else f"CPU equivalent ({os.cpu_count()} cores, small size)"
    )
    return {
        "values": values,
        "summary": summary,
        "met": met,
        "gpu": "taken" if gpu_taken else f"not taken: {reason or NO_GPU}",
        "where": where,
    }


def gpu_world() -> int:
    """Ranks for the multi-rank figures: one per GPU, at most 2 (NCCL refuses two ranks on one
    GPU); 2 gloo ranks on the CPU."""
    return min(2, torch.cuda.device_count()) if GPU else 2


# -- launching runs -------------------------------------------------------------------------------


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, TESTS, env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def launch(world: int, argv: list[str], log: str, extra: dict[str, str] | None = None) -> list[int]:
    """``python -m clusterflow.run ARGV`` as ``world`` local ranks (torchrun's environment), as a
    user would start it; the ranks' exit codes."""
    port, procs = free_port(), []
    with open(log, "a") as out:
        for rank in range(world):
            env = _env(extra)
            if world > 1:
                env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            if not GPU:
                env.setdefault("OMP_NUM_THREADS", "1")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "clusterflow.run", *argv],
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return [p.wait() for p in procs]


def weights(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Tensor by tensor: how many are bitwise equal, and the largest difference."""
    equal = sum(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)
    diff = max(
        (float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel()),
        default=0.0,
    )
    return {
        "tensors": len(a),
        "bitwise_equal_tensors": int(equal),
        "bitwise": a.keys() == b.keys() and equal == len(a),
        "max_abs_diff": diff,
    }


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    if GPU:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


# -- the figures ----------------------------------------------------------------------------------


def environment(quick: bool) -> dict[str, Any]:
    gpus = [
        {
            "name": torch.cuda.get_device_name(i),
            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
        }
        for i in range(torch.cuda.device_count())
    ]
    engine, why = knn.choose_engine("auto")
    values = {
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if GPU else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if GPU else None,
        "driver": _driver(),
        "gpus": gpus,
        "nvml": nvml.read_snapshot() is not None,
        "faiss": _faiss_build(),
        "knn_engine": f"{engine} ({why})",
        "commit": _commit(),
    }
    summary = (
        f"{len(gpus)} x {gpus[0]['name']} ({gpus[0]['memory_gib']} GiB), driver "
        f"{values['driver']}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL "
        f"{values['nccl']}, faiss {values['faiss']}"
        if gpus
        else f"no GPU; torch {torch.__version__}, faiss {values['faiss']}, {os.cpu_count()} CPUs"
    )
    return result(values, summary, None, GPU)


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def _faiss_build() -> str:
    if not knn.faiss_available():
        return "not installed"
    import faiss  # optional: only where it is installed

    kind = "GPU" if hasattr(faiss, "StandardGpuResources") else "CPU"
    return f"{faiss.__version__} ({kind} build)"


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def nccl_two_ranks(quick: bool) -> dict[str, Any]:
    mb = 16 if quick or not GPU else 256
    values: dict[str, Any] = {"all_reduce_mb": mb}
    if GPU:
        nccl = _all_reduce("nccl", mb)
        values["nccl"] = nccl
        if nccl["ok"]:
            summary = (
                f"NCCL, 2 ranks on {nccl['gpus']} GPU(s): all_reduce of {mb} MB exact, "
                f"{nccl['algbw_gbs']:.1f} GB/s"
            )
            return result(values, summary, True, True)
    gloo = _all_reduce("gloo", mb)
    values["gloo"] = gloo
    if GPU:
        summary = (
            f"NCCL refused: {values['nccl']['error']}; gloo fallback (CPU tensors): "
            f"all_reduce {'exact' if gloo['ok'] else 'FAILED'}, {gloo.get('algbw_gbs', 0):.2f} GB/s"
        )
        return result(values, summary, gloo["ok"], True)
    summary = (
        f"gloo fallback, 2 ranks: all_reduce of {mb} MB "
        f"{'exact' if gloo['ok'] else 'FAILED: ' + str(gloo.get('error'))}, "
        f"{gloo.get('algbw_gbs', 0):.2f} GB/s"
    )
    return result(values, summary, gloo["ok"], False)


def _all_reduce(backend: str, mb: int) -> dict[str, Any]:
    """2 processes of this script (``--all-reduce-rank``): their result, or the error."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--all-reduce-rank", str(r), backend, str(port), str(mb)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(timed out after 180 s)")
    for line in outs[0].splitlines():
        if line.startswith("ALL_REDUCE "):
            return json.loads(line[len("ALL_REDUCE ") :])
    said = [line for out in outs for line in out.splitlines() if line.strip()]
    error = next((line for line in said if "Duplicate GPU" in line), None) or (
        said[-1] if said else f"exit codes {[p.returncode for p in procs]}"
    )
    return {"ok": False, "backend": backend, "error": error.strip()[:300]}


def all_reduce_rank(rank: int, backend: str, port: int, mb: int) -> None:
    import torch.distributed as tdist

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    tdist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    n = mb * 2**20 // 4
    x = torch.full((n,), float(rank + 1), device=device)
    tdist.all_reduce(x)  # warm-up; also the check: 1 + 2 everywhere
    ok = bool((x == 3.0).all())
    reps = 5
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        tdist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / reps
    if rank == 0:
        out = {
            "ok": ok,
            "backend": backend,
            "gpus": torch.cuda.device_count() if backend == "nccl" else 0,
            "seconds": seconds,
            "algbw_gbs": mb * 2**20 / seconds / 1e9,
        }
        print("ALL_REDUCE " + json.dumps(out), flush=True)
    tdist.destroy_process_group()


def _bf16_resume(config: str, kill_at: int, quick: bool) -> dict[str, Any]:
    """The config with train.amp=bf16, uninterrupted, and SIGKILLed at step ``kill_at`` (every
    rank: ``testtasks:KillAtEnv``, which trains exactly as PseudoIDTask) then resumed: model.pt
    compared tensor by tensor."""
    world = gpu_world() if GPU else 2
    root = tempfile.mkdtemp(prefix="proof-resume-")
    try:
        base = [
            config,
            "train.amp=bf16",
            "task.target=testtasks:KillAtEnv",
            "train.progress_bar=false",
            f"cluster.tasks_per_node={world}",
        ]
        ref, run = os.path.join(root, "ref"), os.path.join(root, "run")
        log = os.path.join(root, "launch.log")
        t0 = time.perf_counter()
        codes = {"reference": launch(world, [*base, f"run.dir={ref}"], log)}
        ref_s = time.perf_counter() - t0
        kill = {"CLUSTERFLOW_TEST_KILL_AT": str(kill_at)}
        codes["killed"] = launch(world, [*base, f"run.dir={run}"], log, kill)
        codes["resumed"] = launch(world, [*base, f"run.dir={run}"], log)
        ok = codes == {"reference": [0] * world, "killed": [-9] * world, "resumed": [0] * world}
        if not ok or not os.path.exists(RunPaths(run).model):
            with open(log) as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"runs did not end as planned: {codes}\n{tail}")
        with open(RunPaths(run).attempts) as f:
            attempts = [json.loads(line) for line in f if line.strip()]
        values = {
            "config": config,
            "world": world,
            "device": torch.cuda.get_device_name(0) if GPU else "cpu",
            "kill_at_step": kill_at,
            "attempts": len(attempts),
            "reference_s": round(ref_s, 1),
            **compare(weights(RunPaths(ref).model), weights(RunPaths(run).model)),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = (
        f"{world} rank(s), killed at step {kill_at}, resumed: model.pt "
        + (
            "bitwise equal"
            if values["bitwise"]
            else f"NOT bitwise ({values['bitwise_equal_tensors']}/{values['tensors']} tensors "
            f"equal, max diff {values['max_abs_diff']:.3g})"
        )
        + f" ({values['tensors']} tensors)"
    )
    return result(values, summary, values["bitwise"], GPU)


def bf16_resume_tiny(quick: bool) -> dict[str, Any]:
    return _bf16_resume("configs/tiny.yaml", 7, quick)


def bf16_resume_demo(quick: bool) -> dict[str, Any]:
    return _bf16_resume("configs/demo.yaml", 60, quick)


def knn_exact(quick: bool) -> dict[str, Any]:
    n, d, k = (1_200_000, 512, 30) if GPU else ((4000, 64, 30) if quick else (20000, 128, 30))
    device = "cuda" if GPU else "cpu"
    x = bench_knn.blobs(n, d, device)
    ours_s, (_, ids) = timed(knn.search, x, knn.KnnParams(k=k))
    engine, why = knn.choose_engine("auto")
    bare_s, bare_ids = timed(bench_knn.bare_knn, x, k, device)
    # The same neighbour sets (ties may be ordered differently at the cut).
    same = bench_knn.same_sets(ids, bare_ids)
    values = {
        "n": n,
        "d": d,
        "k": k,
        "engine": f"{engine} ({why})",
        "clusterflow_s": round(ours_s, 3),
        "bare_s": round(bare_s, 3),
        "speedup_vs_bare": round(bare_s / ours_s, 2),
        "same_neighbour_sets": round(same, 5),
    }
    summary = (
        f"{n:,} x {d}, k={k}, {engine}: {ours_s:.2f} s vs bare matmul+topk {bare_s:.2f} s "
        f"({bare_s / ours_s:.2f}x), same neighbours for {100 * same:.2f}% of rows"
    )
    return result(values, summary, ours_s < 10 if GPU else None, GPU)


def loop_throughput(quick: bool) -> dict[str, Any]:
    world = gpu_world()
    a = argparse.Namespace(
        nproc=world,
        epochs=2 if GPU else 1,
        identities=2000 if GPU else (60 if quick else 200),
        repeats=2 if GPU else 1,
        amp="bf16" if GPU else "none",
        heartbeats=False,
        heartbeat_s=10.0,
        buckets=False,
    )
    root = tempfile.mkdtemp(prefix="proof-loop-")
    try:
        marginal, _ = bench_trainer.measure(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = {side: min(t for run in runs for t in run) for side, runs in marginal.items()}
    ratio = best["bare"] / best["clusterflow"]
    steps = a.identities * 20 // 128
    values = {
        "ranks": world,
        "amp": a.amp,
        "steps_per_epoch": steps,
        "best_epoch_s": {k: round(v, 4) for k, v in best.items()},
        "median_epoch_s": {
            side: round(statistics.median(t for run in runs for t in run), 4)
            for side, runs in marginal.items()
        },
        "throughput_vs_bare": round(ratio, 3),
    }
    summary = (
        f"{world} rank(s), {steps} steps/epoch, {a.amp}: clusterflow "
        f"{steps / best['clusterflow']:.1f} steps/s, bare DDP {steps / best['bare']:.1f}: "
        f"{ratio:.3f}x"
    )
    return result(values, summary, ratio >= 0.95 if GPU else None, GPU)


def embed_throughput(quick: bool) -> dict[str, Any]:
    n, size, image_size, workers, repeats = (
        (8000, 256, 64, 8, 3) if GPU else ((120, 64, 16, 0, 2) if quick else (400, 64, 32, 0, 3))
    )
    root = tempfile.mkdtemp(prefix="proof-embed-")
    try:
        bench_embed.generate(root, n, size)
        device = torch.device("cuda" if GPU else "cpu")
        task = ImageFolderTask(root=root, image_size=image_size)
        model = task.build_model().to(device).eval()
        ds = task.embed_dataset()
        equal = bool(
            np.array_equal(
                bench_embed.ours(task, model, ds, 256, workers, device),
                bench_embed.bare(task, model, ds, 256, workers, device),
            )
        )
        times: dict[str, list[float]] = {"clusterflow": [], "bare": []}
        for r in range(repeats):
            sides = [("clusterflow", bench_embed.ours), ("bare", bench_embed.bare)]
            for name, fn in sides if r % 2 == 0 else sides[::-1]:
                times[name].append(bench_embed.timed(fn, task, model, ds, 256, workers, device))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rate = {k: n / min(v) for k, v in times.items()}
    ratio = rate["clusterflow"] / rate["bare"]
    values = {
        "images": n,
        "image_size": image_size,
        "workers": workers,
        "images_per_s": {k: round(v, 1) for k, v in rate.items()},
        "same_embeddings": equal,
        "throughput_vs_bare": round(ratio, 3),
    }
    summary = (
        f"{n} JPEGs -> {image_size} px, {workers} workers: {rate['clusterflow']:.0f} img/s vs bare "
        f"{rate['bare']:.0f} ({ratio:.3f}x), embeddings {'equal' if equal else 'DIFFER'}"
    )
    return result(values, summary, (ratio >= 0.95 and equal) if GPU else None, GPU)


def nvml_heartbeats(quick: bool) -> dict[str, Any]:
    if not GPU:
        why = "no GPU: NVML has nothing to read" + (
            "" if nvml.read_snapshot() is None else " (NVML answered, yet torch sees no GPU)"
        )
        return result({"nvml": nvml.read_snapshot() is not None}, why, None, False, why)
    root = tempfile.mkdtemp(prefix="proof-nvml-")
    try:
        run = os.path.join(root, "run")
        codes = launch(
            1,
            [
                "configs/demo.yaml",
                f"run.dir={run}",
                "cluster.tasks_per_node=1",
                "train.epochs=2",
                "dist.heartbeat_s=1",
                "train.progress_bar=false",
            ],
            os.path.join(root, "launch.log"),
        )
        with open(RunPaths(run).heartbeat_file(0)) as f:
            beat = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gpu = {k: v for k, v in beat.items() if k.startswith("gpu")}
    ok = codes == [0] and gpu.get("gpu_mem_used_mb") is not None
    summary = (
        f"heartbeat of rank 0: GPU {gpu.get('gpu_index')} "
        f"{gpu.get('gpu_mem_used_mb')}/{gpu.get('gpu_mem_total_mb')} MB used, "
        f"{gpu.get('gpu_util_pct')}% util, {gpu.get('gpu_temp_c')} C"
    )
    return result({"exit_codes": codes, "heartbeat_gpu_fields": gpu}, summary, ok, True)


class DeepPseudoID(PseudoIDTask):
    """PseudoIDTask's data and loss with a model of ``depth`` square blocks (LayerNorm, GELU,
    Linear of ``hidden`` x ``hidden``) in one Sequential: many FSDP units, none of them a large
    part of the model, so that a rank's share is what its shards need."""

    def __init__(
        self,
        seed: int = 0,
        identities: int = 100,
        samples_per_identity: int = 20,
        input_dim: int = 64,
        hidden: int = 128,
        embed_dim: int = 32,
        depth: int = 4,
    ) -> None:
        super().__init__(
            seed=seed,
            identities=identities,
            samples_per_identity=samples_per_identity,
            input_dim=input_dim,
            hidden=hidden,
            embed_dim=embed_dim,
        )
        self.depth, self.input_dim = depth, input_dim

    def build_model(self) -> torch.nn.Module:
        nn, h = torch.nn, self.hidden
        layers: list[torch.nn.Module] = [nn.Linear(self.input_dim, h)]
        for _ in range(self.depth):
            layers += [nn.LayerNorm(h), nn.GELU(), nn.Linear(h, h)]
        layers += [nn.LayerNorm(h), nn.GELU(), nn.Linear(h, self.embed_dim)]
        return _Normalized(nn.Sequential(*layers))


class _Normalized(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.net(x), dim=-1)


def fsdp_over_share(quick: bool) -> dict[str, Any]:
    """train.parallel=fsdp on 2 ranks with a rank's GPU memory capped at a share that a DDP
    replica (fp32 parameters, gradients and AdamW's two moments) does not fit in."""
    two_gpus = GPU and torch.cuda.device_count() >= 2
    hidden, depth = (4096, 24) if two_gpus else ((64, 4) if quick else (128, 6))
    with torch.device("meta"):
        model = DeepPseudoID(hidden=hidden, depth=depth).build_model()
    params = sum(p.numel() for p in model.parameters())
    replica = 16 * params  # fp32 parameters + gradients + AdamW's two moments
    share = int(0.75 * replica)
    sides = {
        parallel: _fsdp_run(parallel, hidden, depth, share if two_gpus else None)
        for parallel in ("fsdp", "ddp")
    }
    fsdp = sides["fsdp"]
    rank_bytes = max(r["state_bytes"] for r in fsdp["ranks"]) if fsdp["ok"] else None
    values = {
        "parameters": params,
        "hidden": hidden,
        "depth": depth,
        "replica_bytes": replica,
        "share_bytes": share,
        "fsdp": fsdp,
        "ddp": sides["ddp"],
    }
    if two_gpus:
        peak = max(r["peak_bytes"] for r in fsdp["ranks"]) if fsdp["ok"] else None
        met = fsdp["ok"] and not sides["ddp"]["ok"]
        summary = (
            f"{params / 1e6:.0f}M parameters, replica {replica / 2**30:.1f} GiB > share "
            f"{share / 2**30:.1f} GiB: fsdp "
            + (f"trained, peak {peak / 2**30:.2f} GiB a rank" if fsdp["ok"] else "FAILED")
            + f"; ddp {'trained (unexpected)' if sides['ddp']['ok'] else 'out of memory'}"
        )
        return result(values, summary, met, True)
    ddp = sides["ddp"]
    ddp_bytes = max(r["state_bytes"] for r in ddp["ranks"]) if ddp["ok"] else None
    met = fsdp["ok"] and rank_bytes is not None and rank_bytes < share < (ddp_bytes or replica)
    summary = (
        f"gloo, 2 ranks, {params / 1e3:.0f}k parameters, AdamW: fsdp holds "
        f"{(rank_bytes or 0) / 2**20:.3f} MiB of state a rank, ddp "
        f"{(ddp_bytes or 0) / 2**20:.3f} MiB; a share of {share / 2**20:.3f} MiB (3/4 of a "
        "replica) holds the first, not the second (measured, not enforced on the CPU)"
    )
    reason = (
        "one GPU: FSDP over NCCL needs 2 GPUs (NCCL refuses two ranks on one GPU); the CPU "
        "equivalent below ran"
        if GPU
        else ""
    )
    return result(values, summary, met, False, reason)


def _fsdp_run(parallel: str, hidden: int, depth: int, share: int | None) -> dict[str, Any]:
    """2 ranks of ``--fsdp-rank`` (clusterflow.run with its rank's bytes measured)."""
    root = tempfile.mkdtemp(prefix=f"proof-{parallel}-")
    try:
        argv = [
            "configs/tiny.yaml",
            f"run.dir={os.path.join(root, 'run')}",
            f"train.parallel={parallel}",
            "train.optimizer=adamw",
            # With fewer than 2 GPUs, the CPU equivalent: gloo, which clusterflow runs on the CPU.
            *(["train.amp=bf16"] if share else ["train.amp=none", "dist.backend=gloo"]),
            "train.epochs=1",
            "train.eval_every_epochs=0",
            "mining.enabled=false",
            "checkpoint.every_steps=1000000",
            "task.target=gpu_proof:DeepPseudoID",
            "task.params.input_dim=64",  # DeepPseudoID's defaults, as the figure counted them
            "task.params.embed_dim=32",
            f"task.params.hidden={hidden}",
            f"task.params.depth={depth}",
        ]
        code, output, _ = bench_trainer.torchrun_output(
            2, [__file__, "--fsdp-rank", str(share or 0), root, *argv]
        )
        ranks = []
        for name in sorted(os.listdir(root)):
            if name.startswith("bytes-rank"):
                with open(os.path.join(root, name)) as f:
                    ranks.append(json.load(f))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = code == 0 and len(ranks) == 2
    said = (
        ""
        if ok
        else next(
            (line for line in output if "OutOfMemory" in line or "out of memory" in line),
            output[-1] if output else f"exit {code}",
        )
    )
    return {"ok": ok, "ranks": ranks, "error": said.strip()[:300]}


def fsdp_rank(share: int, out_dir: str, argv: list[str]) -> None:
    """One rank of the fsdp figure, under torchrun: its GPU memory capped at ``share`` bytes (0:
    no cap), ``clusterflow.run ARGV``, then its bytes of parameters, gradients and optimizer
    state (and the peak GPU memory) written to ``OUT_DIR/bytes-rank<R>.json``."""
    if GPU and share:
        device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(share / total, device)
    step, fit, most = Trainer._optimizer_step, Trainer.fit, {}

    def measured_step(self: Trainer, *args: Any) -> None:
        # Before the update: parameters, their gradients and (from the second step) the
        # optimizer's state all live, as in every step of a long run.
        sizes = bench_sharded.local_bytes(self.module, self.opt)
        if sum(sizes.values()) > sum(most.values()):
            most.update(sizes)
        step(self, *args)

    def measured_fit(self: Trainer) -> str:
        outcome = fit(self)
        out = {
            "rank": int(os.environ.get("RANK", "0")),
            "state_bytes": sum(most.values()),
            **most,
            "peak_bytes": torch.cuda.max_memory_allocated() if GPU and share else None,
        }
        with open(os.path.join(out_dir, f"bytes-rank{out['rank']}.json"), "w") as f:
            json.dump(out, f)
        return outcome

    Trainer._optimizer_step, Trainer.fit = measured_step, measured_fit
    job_run._exit(job_run.main(argv))


FIGURES = [
    Figure("environment", "environment", "", 60, environment),
    Figure("nccl_two_ranks", "2-process NCCL", "all_reduce exact", 240, nccl_two_ranks),
    Figure(
        "bf16_resume_tiny",
        "tiny, bf16, SIGKILL + resume",
        "model.pt bitwise",
        300,
        bf16_resume_tiny,
    ),
    Figure("knn_exact", "exact k-NN 1.2M x 512, k=30", "< 10 s", 300, knn_exact),
    Figure("loop_throughput", "training loop vs bare DDP", ">= 0.95x", 420, loop_throughput),
    Figure("embed_throughput", "mining embed vs bare loop", ">= 0.95x", 300, embed_throughput),
    Figure(
        "bf16_resume_demo",
        "demo, bf16, SIGKILL + resume",
        "model.pt bitwise",
        420,
        bf16_resume_demo,
    ),
    Figure("nvml_heartbeats", "NVML in heartbeats", "GPU fields present", 180, nvml_heartbeats),
    Figure(
        "fsdp_over_share",
        "FSDP2, model over a replica's share",
        "fsdp fits, ddp does not",
        420,
        fsdp_over_share,
    ),
]
BY_NAME = {f.name: f for f in FIGURES}
QUICK_SKIPS = {"bf16_resume_demo": "not taken: --quick leaves the demo out (the tiny one ran)"}


# -- the driver -----------------------------------------------------------------------------------


def take(fig: Figure, quick: bool, limit: float, log: str) -> dict[str, Any]:
    """Run one figure in a child process within ``limit`` seconds; its result, or why not."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, "--figure", fig.name, "--result", out]
    cmd += ["--quick"] if quick else []
    t0 = time.perf_counter()
    try:
        with open(log, "a") as lf:
            lf.write(f"\n=== {fig.name} ===\n")
            lf.flush()
            child = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=_env(),
                stdout=lf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                code = child.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                return _failed(f"timed out after {limit:.0f} s", time.perf_counter() - t0)
        if code != 0 or not os.path.getsize(out):
            with open(log) as lf:
                tail = lf.read().splitlines()[-3:]
            return _failed(f"exit {code}: {' | '.join(tail)}"[:500], time.perf_counter() - t0)
        with open(out) as f:
            res = json.load(f)
    finally:
        os.unlink(out)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def _failed(why: str, seconds: float) -> dict[str, Any]:
    return {
        "values": {},
        "summary": f"FAILED: {why}",
        "met": False,
        "gpu": "not taken: the figure failed" if GPU else f"not taken: {NO_GPU}",
        "where": "",
        "seconds": round(seconds, 1),
    }


def report_md(report: dict[str, Any]) -> str:
    """The report as one markdown table (what docs/benchmarks.md takes)."""
    env = report["figures"].get("environment", {}).get("summary", "")
    sizes = "quick sizes" if report["quick"] else "full sizes"
    lines = [f"GPU proof of {report['started']}, {sizes}: {env}.", ""]
    if not report["gpu"]:
        lines += [
            (
                f"No GPU here (torch {torch.__version__}): every GPU figure is not taken; each row "
                "is its CPU equivalent at a small size."
            ),
            "",
        ]
    lines += ["| figure | ran on | result | goal | met |", "|---|---|---|---|---|"]
    for fig in FIGURES:
        r = report["figures"].get(fig.name)
        if r is None:
            continue
        met = {True: "yes", False: "**no**", None: "-"}[r.get("met")]
        where = r.get("where") or "-"
        if r["gpu"] != "taken" and (report["gpu"] or not r["gpu"].endswith(NO_GPU)):
            where += f" ({r['gpu']})"  # a reason other than "no GPU here"
        cells = [fig.title, where, r["summary"], fig.goal or "-", met]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write(out_dir: str, report: dict[str, Any]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for name, text in (
        ("proof.json", json.dumps(report, indent=1)),
        ("proof.md", report_md(report)),
    ):
        tmp = os.path.join(out_dir, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out_dir, name))


def drive(a: argparse.Namespace) -> int:
    names = [n.strip() for n in a.only.split(",")] if a.only else [f.name for f in FIGURES]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"error: --only names unknown figures {unknown}; figures: {list(BY_NAME)}")
        return 2
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "quick": a.quick,
        "gpu": GPU,
        "figures": {},
    }
    log = os.path.join(a.out, "proof.log")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    for name in names:
        fig = BY_NAME[name]
        left = a.budget_s - (time.perf_counter() - t0)
        limit = fig.limit_s if GPU else fig.limit_s / 2
        if a.quick and name in QUICK_SKIPS:
            res = _failed("", 0) | {"summary": "skipped (--quick)", "met": None}
            res["gpu"] = QUICK_SKIPS[name]
        elif left < min(limit, 60):
            res = _failed(f"not started: {left:.0f} s of --budget-s left", 0) | {"met": None}
            res["gpu"] = "not taken: the budget ran out (run it with --only)"
        else:
            print(f"{name} ...", flush=True)
            res = take(fig, a.quick, min(limit, left), log)
        report["figures"][name] = res
        print(f"  {res['summary']} ({res.get('seconds', 0)} s)", flush=True)
        write(a.out, report)
    print(report_md(report))
    return 0


def merge(paths: list[str], out_dir: str) -> int:
    """Reports of several calls (e.g. --only halves of one lease) into one: later ones win."""
    merged: dict[str, Any] = {}
    for path in paths:
        with open(path) as f:
            one = json.load(f)
        merged = {**one, "figures": {**merged.get("figures", {}), **one["figures"]}}
    write(out_dir, merged)
    print(report_md(merged))
    return 0


def main() -> None:
    if sys.argv[1:2] == ["--all-reduce-rank"]:
        rank, backend, port, mb = sys.argv[2:6]
        all_reduce_rank(int(rank), backend, int(port), int(mb))
        return
    if sys.argv[1:2] == ["--fsdp-rank"]:
        fsdp_rank(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
        return
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", help="folder for proof.json, proof.md and proof.log (required)")
    p.add_argument("--only", help="comma-separated figure names (default: all, in order)")
    p.add_argument("--quick", action="store_true", help="small sizes; leaves the demo run out")
    p.add_argument(
        "--budget-s",
        type=float,
        default=3600,
        help="start no figure that could outlast this many seconds from the start (default "
        "3600; 560 inside one 10-minute device call)",
    )
    p.add_argument("--merge", nargs="+", metavar="PROOF_JSON", help="merge reports into --out")
    p.add_argument("--figure", help=argparse.SUPPRESS)  # internal: take one figure
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.figure:
        res = BY_NAME[a.figure].take(a.quick)
        with open(a.result, "w") as f:
            json.dump(res, f)
        return
    if not a.out:
        p.error("--out DIR is required")
    sys.exit(merge(a.merge, a.out) if a.merge else drive(a))


if __name__ == "__main__":
    main()
