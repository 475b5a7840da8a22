"""Bad run dirs, checkpoint URLs, batch sizes and failing task code: refused at submit and at run
with one line (exit 2), or the task's traceback under one line naming task.target (exit 1), the
same exit status from `run` and `submit --local` (issue 12)."""

import contextlib
import os
import subprocess
import sys

import fsspec
import launch
import pytest
from clihelp import call, one_error_line
from conftest import REPO, tmpfs
from fsspec.registry import known_implementations

from clusterflow import config, rundir, tasks
from clusterflow.job import run
from clusterflow.launch import submit

TINY = [
    "task.target=testtasks:Tiny",
    "task.params={}",
    "train.batch_size=8",
    "train.epochs=1",
    "mining.enabled=false",
    "cluster.tasks_per_node=1",
    "train.eval_every_epochs=0",
    "checkpoint.every_steps=1000",
]
TINY_YAML = os.path.join(REPO, "configs", "tiny.yaml")
TESTS_ENV = {"PYTHONPATH": os.path.join(REPO, "tests")}


def both_refuse(args):
    """`submit --dry-run` and `run --check` with ``args``: both exit 2 with one error line, which is
    returned."""
    lines = []
    for main, extra in ((submit.main, ["--dry-run"]), (run.main, ["--check"])):
        code, _out, err = call(main, [TINY_YAML, *TINY, *args, *extra])
        assert code == 2 and "Traceback" not in err, (main, err)
        lines.append(one_error_line(err))
    assert lines[0] == lines[1]
    return lines[0]


# -- the run dir ----------------------------------------------------------------------------------


def test_run_dir_that_is_a_file_or_under_one(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert both_refuse([f"run.dir={f}"]) == (
        f"error: run.dir = '{f}' is a file, not a directory; pick another path, or move the "
        "file away"
    )
    assert f"lies under '{f}', which is a file" in both_refuse([f"run.dir={f}/sub/run"])
    assert "checkpoint.dir" in both_refuse([f"run.dir={tmp_path}/ok", f"checkpoint.dir={f}/ck"])


def test_real_submit_and_run_refuse_a_bad_run_dir(tmp_path):
    """Not only the dry run and the check: the commands that would start a job refuse too
    (in-process, tests/clihelp.call, as python -m runs them: a refusal ends before anything
    starts)."""
    f = tmp_path / "file"
    f.write_text("x")
    for main, extra in ((submit.main, ["--local"]), (submit.main, []), (run.main, [])):
        code, _, err = call(main, [*extra, "configs/tiny.yaml", f"run.dir={f}/run"])
        assert code == 2 and "Traceback" not in err, (main, extra, err)
        assert (
            one_error_line(err)
            == f"error: run.dir = '{f}/run' lies under '{f}', which is a file, not a "
            f"directory; pick another path, or move the file away"
        )


@pytest.mark.parametrize("path", ["/proc/run", "/sys/kernel/run", "/dev/run", "/proc"])
def test_run_dir_in_a_kernel_filesystem(path):
    top = "/" + path.split("/")[1]
    assert f"is under {top}, a kernel filesystem that holds no files" in both_refuse(
        [f"run.dir={path}"]
    )


def test_run_dir_on_a_read_only_filesystem(tmp_path):
    ro = tmp_path / "ro"
    with tmpfs(ro, "ro,size=1m"):
        assert f"'{ro}' is on a read-only filesystem" in both_refuse([f"run.dir={ro}/run"])


def test_run_dir_symlink_to_nowhere(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    assert "is a symbolic link to" in both_refuse([f"run.dir={tmp_path}/link/run"])


@pytest.mark.parametrize(
    "url", ["memory://runs/x", "s3://bucket/runs/x", "gs://b/x", "simplecache::s3://b/x"]
)
def test_run_dir_url_is_refused_with_the_checkpoint_dir_fix(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = both_refuse([f"run.dir={url}"])
    assert "is a URL, but the run dir must be a filesystem path shared by all nodes" in line
    assert line.endswith(f"checkpoint.dir={url}")
    assert os.listdir(tmp_path) == []  # no 'memory:' or 's3:' folder


def test_file_url_is_the_path(tmp_path):
    code, out, err = call(
        run.main, ["configs/tiny.yaml", *TINY, f"run.dir=file://{tmp_path}/r", "--check"]
    )
    assert code == 0 and f"run dir {tmp_path}/r" in out, err


def _missing_backend():
    for protocol, spec in known_implementations.items():
        if spec.get("err", "").lower().startswith(("install", "please install")):
            try:
                fsspec.get_filesystem_class(protocol)
            except ImportError:
                return protocol, spec["err"]
    pytest.skip("every fsspec backend with an install hint is installed here")


def test_checkpoint_url_without_its_package_fails_at_submit(tmp_path):
    protocol, hint = _missing_backend()
    package = hint.split("nstall ")[1].split()[0]
    line = both_refuse([f"run.dir={tmp_path}/r", f"checkpoint.dir={protocol}://bucket/ck"])
    assert f"fsspec cannot open {protocol}:// here ({hint}); pip install {package}" in line
    assert "fsspec knows no protocol 'nope'" in both_refuse(
        [f"run.dir={tmp_path}/r", "checkpoint.dir=nope://b/ck"]
    )
    code, _out, err = call(
        run.main,
        [
            "configs/tiny.yaml",
            *TINY,
            f"run.dir={tmp_path}/r",
            "checkpoint.dir=memory://ck",
            "--check",
        ],
    )
    assert code == 0, err


# -- batch size, task parameters and the user's task code ------------------------------------------


def test_batch_larger_than_the_dataset(tmp_path):
    code, _out, err = call(
        run.main,
        ["configs/tiny.yaml", *TINY, f"run.dir={tmp_path}/r", "train.batch_size=64", "--check"],
    )
    assert code == 2 and one_error_line(err) == (
        "error: train.batch_size = 64 is larger than the training set of testtasks:Tiny (16 "
        "samples), so an epoch has no full batch; lower train.batch_size to at most 16 (a multiple "
        "of world size x grad_accum = 1)"
    )
    assert not os.path.exists(tmp_path / "r")  # --check writes nothing


@pytest.mark.parametrize(
    "args,needle",
    [
        (["task.target=testtasks:Nope"], "testtasks has no class 'Nope'; classes there:"),
        (["task.target=no_such_module:Task"], "module 'no_such_module' not found"),
        (["task.target=.relative:Task"], "must look like package.module:ClassName"),
        (
            ["task.params.sise=3"],
            (
                "task.params for testtasks:Tiny: got an unexpected keyword argument 'sise'; its "
                "parameters: size, fail_in, hidden"
            ),
        ),
        (
            ["task.params.size=abc"],
            "task.params.size = 'abc' is invalid for Tiny: expected an integer",
        ),
        (
            ["task.params.size=1.5"],
            "task.params.size = 1.5 is invalid for Tiny: expected an integer",
        ),
        (
            ["task.params.fail_in=3"],
            "task.params.fail_in = 3 is invalid for Tiny: expected a string",
        ),
        (["task.params.size=1"], "task.params.size = 1: must be between 4 and 256"),
    ],
)
def test_task_that_cannot_be_built_is_bad_input(tmp_path, args, needle):
    code, _out, err = call(
        run.main, ["configs/tiny.yaml", *TINY, f"run.dir={tmp_path}/r", *args, "--check"]
    )
    assert code == 2 and "Traceback" not in err and needle in one_error_line(err), err


@pytest.mark.parametrize("target", ["builtins:dict", "builtins:int", "os:getcwd"])
def test_a_target_that_is_not_a_task(tmp_path, target):
    code, _out, err = call(
        run.main, [TINY_YAML, *TINY, f"run.dir={tmp_path}/r", f"task.target={target}", "--check"]
    )
    assert (
        code == 2
        and f"task.target={target!r} is not a task: it has no build_model, train_dataset, loss"
        in err
    )


def test_task_params_are_read_as_their_annotated_types(tmp_path):
    code, out, err = call(
        run.main,
        ["configs/tiny.yaml", *TINY, f"run.dir={tmp_path}/r", "task.params.size=3.2e1", "--check"],
    )
    assert code == 0 and "with 32 training samples" in out, err


@contextlib.contextmanager
def _importable(monkeypatch, tmp_path, name, body):
    """The task module ``name`` written in ``tmp_path`` and importable in this process, for the
    in-process commands (tests/clihelp.call); forgotten again afterwards."""
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield
    finally:
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "name,body,header,shown",
    [
        (
            "needs_dep",
            "import nonexistent_pkg_cf\n",
            (
                "task.target 'needs_dep:T': importing needs_dep failed because the module it "
                "imports, 'nonexistent_pkg_cf', is not installed; install it where the job runs "
                "(e.g. pip install nonexistent_pkg_cf)"
            ),
            "import nonexistent_pkg_cf",
        ),
        (
            "bad_syntax",
            "def f(:\n",
            "task.target 'bad_syntax:T': importing bad_syntax failed: SyntaxError: invalid syntax",
            "def f(:",
        ),
        (
            "raises_in_init",
            (
                "from clusterflow.tasks import Task\nclass T(Task):\n    def __init__(self, "
                "seed=0):\n        raise RuntimeError('boom')\n"
            ),
            "task.target 'raises_in_init:T' failed in T.__init__: RuntimeError: boom",
            "raise RuntimeError('boom')",
        ),
    ],
)
def test_task_code_failing_keeps_its_traceback_under_one_line(
    monkeypatch, tmp_path, name, body, header, shown
):
    args = ["configs/tiny.yaml", *TINY, f"run.dir={tmp_path}/r", f"task.target={name}:T"]
    with _importable(monkeypatch, tmp_path, name, body):
        code, _, err = call(run.main, [*args, "--check"])
    assert code == 1, err
    first, rest = err.split("\n", 1)
    assert first.startswith(f"error: {header}"), err
    assert "Traceback (most recent call last)" in rest and shown in rest
    assert "not found" not in first


def _run_both_routes(tmp_path, args):
    """Exit status and stderr of `run` and of `submit --local` for the same failing config."""
    results = []
    for i, cmd in enumerate((["clusterflow.run"], ["clusterflow.submit", "--local"])):
        d = tmp_path / f"route{i}"
        out = subprocess.run(
            [sys.executable, "-m", *cmd, "configs/tiny.yaml", *TINY, f"run.dir={d}", *args],
            check=False,
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, **TESTS_ENV},
            timeout=300,
        )
        status = rundir.read_json(rundir.RunPaths(str(d)).status, {})
        results.append((out.returncode, out.stdout + out.stderr, status))
    return results


def test_submit_local_and_run_agree_on_bad_input(tmp_path):
    for code, text, status in _run_both_routes(tmp_path, ["train.batch_size=64"]):
        assert code == 2 and "Traceback" not in text, text
        assert "error: " in text and "train.batch_size = 64 is larger than the training set" in text
        assert status["state"] == "failed" and status["exit_code"] == 2


@pytest.mark.parametrize("where", ["build_model", "loss"])
def test_submit_local_and_run_agree_on_task_code_failing(tmp_path, where):
    for code, text, status in _run_both_routes(tmp_path, [f"task.params.fail_in={where}"]):
        assert code == 1, text
        assert (
            f"task.target 'testtasks:Tiny' failed in {where} (" in text and "testtasks.py" in text
        )
        assert (
            f"ValueError: deliberate failure in {where}" in text
            and "Traceback (most recent call last)" in text
        )
        assert status["exit_code"] == 1 and f"failed in {where}" in status["error"]


def test_failed_first_start_does_not_block_the_fixed_resubmission(cli, tmp_path):
    d = tmp_path / "r"
    broken = cli(
        "clusterflow.run",
        "configs/tiny.yaml",
        *TINY,
        f"run.dir={d}",
        "task.params.size=2",
        env=TESTS_ENV,
    )
    assert (
        broken.returncode == 2
        and "task.params.size = 2: must be between 4 and 256" in broken.stderr
    )
    fixed = cli(
        "clusterflow.run",
        "configs/tiny.yaml",
        *TINY,
        f"run.dir={d}",
        "task.params.size=16",
        env=TESTS_ENV,
    )
    assert fixed.returncode == 0, fixed.stderr
    assert (
        "has no committed checkpoint, so nothing to resume: its config.yaml is replaced"
        in fixed.stderr
    )
    saved = rundir.read_json(rundir.RunPaths(str(d)).status)
    assert saved["state"] == "completed"
    # Once a checkpoint is committed, a different config is refused (the usual resume check).
    again = cli(
        "clusterflow.run",
        "configs/tiny.yaml",
        *TINY,
        f"run.dir={d}",
        "task.params.size=32",
        env=TESTS_ENV,
    )
    assert (
        again.returncode == 2
        and "holds a run with a different config (task.params.size 16 -> 32" in again.stderr
    )


def test_failed_first_start_via_submit(tmp_path):
    d = tmp_path / "r"
    args = [TINY_YAML, *TINY, f"run.dir={d}"]
    assert (
        call(submit.main, [*args, "task.params.size=2", "--dry-run"])[0] == 0
    )  # submit cannot see task params
    os.makedirs(d)
    (d / "config.yaml").write_text(
        config.load(TINY_YAML, [*TINY, f"run.dir={d}", "task.params.size=2"]).to_yaml()
    )
    code, _out, err = call(submit.main, [*args, "--dry-run"])
    assert (
        code == 0
        and "its config.yaml is replaced by this config (task.params: {'size': 2} -> {})" in err
    )


def test_limits_that_keep_a_valid_config_runnable(tmp_path):
    long = "x" * 300
    assert "longer than the filesystem allows (255 bytes a name" in both_refuse(
        [f"run.dir={tmp_path}/{long}"]
    )
    assert "data.num_workers = 100000: must be between 0 and 256" in both_refuse(
        ["data.num_workers=1e5"]
    )
    assert "dist.timeout_s = 100000000000: must be between 10 and 31536000" in both_refuse(
        ["dist.timeout_s=1e11"]
    )
    assert "mining.hnsw_m = 4294967296: must be between 1 and 2147483647" in both_refuse(
        ["mining.hnsw_m=4294967296"]
    )
    protocol, _hint = _missing_backend()
    assert f"task.init_from = '{protocol}://b/model.pt': fsspec cannot open" in both_refuse(
        [f"run.dir={tmp_path}/r", f"task.init_from={protocol}://b/model.pt"]
    )


@pytest.mark.parametrize(
    "extra,needle",
    [
        ("{'a b': 1}", "cluster.sbatch_extra = 'a b': keys are sbatch option names"),
        ("{begin: [1, 2]}", "cluster.sbatch_extra.begin = [1, 2]: must be one value on one line"),
        ('{begin: "now\\n#SBATCH --qos=high"}', "must be one value on one line"),
    ],
)
def test_sbatch_extra_is_one_option_per_line(extra, needle):
    assert needle in both_refuse([f"cluster.sbatch_extra={extra}"])


def test_long_values_are_cut_in_messages():
    line = both_refuse(["train.epochs=" + "9" * 3000])
    assert "an integer of 3000 digits" not in line and "out of range" in line and len(line) < 300
    line = both_refuse(["run.seed=" + "9" * 5000])
    assert "an integer of 5000 digits" in line and len(line) < 400
    assert both_refuse(["train.epochs="]).endswith(
        "train.epochs is empty; give it a value, or remove the key to use its default"
    )


@pytest.mark.slurm
def test_sbatch_refusal_is_one_line(cluster, tmp_path):
    code, _out, err = call(
        submit.main,
        [TINY_YAML, *TINY, f"run.dir={tmp_path}/r", "cluster.sbatch_extra={begin: notatime}"],
    )
    assert code == 2 and "Traceback" not in err
    line = one_error_line(err)
    assert (
        line.startswith("error: sbatch refused the job (")
        and "Invalid --begin specification" in line
    ), err
    assert err.strip() == line


@pytest.mark.parametrize(
    "param, shown",
    [
        (
            "identities=1",
            "task.params.identities = 1 is out of range for PseudoIDTask: must be >= 2",
        ),
        (
            "temperature=0",
            "task.params.temperature = 0 is out of range for PseudoIDTask: must be > 0",
        ),
        (
            "keep=1.5",
            "task.params.keep = 1.5 is out of range for PseudoIDTask: must be >= 0 and <= 1",
        ),
        ("noise=.nan", "task.params.noise = nan is out of range for PseudoIDTask: must be >= 0"),
    ],
)
def test_a_task_param_out_of_its_declared_range_is_refused_at_submit(tmp_path, param, shown):
    d = tmp_path / "r"
    code, _out, err = call(
        submit.main, ["configs/tiny.yaml", "--local", f"run.dir={d}", f"task.params.{param}"]
    )
    assert code == 2 and one_error_line(err) == f"error: {shown}", err
    assert not d.exists()  # refused before the run dir is written


@pytest.mark.parametrize(
    "param, shown",
    [
        (
            "image_size=4",
            (
                "task.params.image_size = 4 is out of range for ImageFolderTask: must be >= 8 and "
                "<= 1024 (pixels per side)"
            ),
        ),
        (
            "channels=2",
            (
                "task.params.channels = 2 is out of range for ImageFolderTask: must be one of 1, 3 "
                "(grey or RGB)"
            ),
        ),
        (
            "backbone=vgg",
            (
                "task.params.backbone = 'vgg' is out of range for ImageFolderTask: must be one of "
                "small, resnet18"
            ),
        ),
    ],
)
def test_an_image_task_param_is_refused_at_submit_not_in_the_job(tmp_path, param, shown):
    """The image tasks declare their values (Range, OneOf): a bad one never reaches the queue."""
    d = tmp_path / "r"
    argv = ["configs/images_digits.yaml", "--local", f"run.dir={d}", f"task.params.{param}"]
    code, _out, err = call(submit.main, argv)
    assert code == 2 and one_error_line(err) == f"error: {shown}", err
    assert not d.exists()


def test_one_of_takes_its_values_and_no_lookalike():
    choice = tasks.OneOf(1, 3, what="grey or RGB")
    assert choice.holds(1) and choice.holds(3) and choice.holds(3.0)
    assert not choice.holds(True) and not choice.holds(2) and not choice.holds("3")
    assert str(choice) == "one of 1, 3 (grey or RGB)"
    flag = tasks.OneOf(True)
    assert flag.holds(True) and not flag.holds(1)


def test_a_users_task_declares_its_ranges_in_its_annotations(monkeypatch, tmp_path):
    body = (
        "from typing import Annotated\n"
        "from clusterflow.tasks import Range\n"
        "from testtasks import Tiny\n"
        "class T(Tiny):\n"
        "    def __init__(self, seed=0, size: Annotated[int, Range(8, 64)] = 16,\n"
        "                 dropout: Annotated[float, Range(0, 1, open_max=True)] = 0.0):\n"
        "        super().__init__(seed, size=size)\n"
    )
    base = ["configs/tiny.yaml", *TINY, "task.target=ranged:T", f"run.dir={tmp_path}/r"]
    with _importable(monkeypatch, tmp_path, "ranged", body):
        for value, want in [
            ("size=65", "task.params.size = 65 is out of range for T: must be >= 8 and <= 64"),
            ("dropout=1", "task.params.dropout = 1 is out of range for T: must be >= 0 and < 1"),
        ]:
            code, _, err = call(submit.main, [*base, "--local", f"task.params.{value}"])
            assert code == 2 and err.strip() == f"error: {want}", err
            assert not (tmp_path / "r").exists()
        code, _, err = call(run.main, [*base, "task.params.size=8", "--check"])
    assert code == 0, err


def test_a_warning_of_many_lines_is_one_line_on_the_console_and_whole_in_the_log(cli, tmp_path):
    d = tmp_path / "r"
    out = cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        *TINY,
        "task.target=testtasks:WarnsInBuild",
        "--local",
        f"run.dir={d}",
        env=TESTS_ENV,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    console = out.stdout + out.stderr
    whole = str(d / "warnings" / "rank0.attempt0.txt")
    said = [line for line in console.splitlines() if "long warning" in line]
    assert len(said) == 1 and said[0].endswith(
        "WARNING clusterflow.warnings: UserWarning: first line of a long warning (the whole "
        f"warning: {whole})"
    ), console
    assert "torch internals" not in console
    assert said[0] in open(d / "logs" / "rank0.attempt0.log").read().splitlines()
    kept = open(whole).read()
    assert "first line of a long warning\nsecond line, torch internals\nthird line" in kept
    assert "UserWarning at " in kept and "testtasks.py:" in kept  # where it was raised


def test_a_model_with_parameters_its_loss_never_uses_names_the_key_that_allows_it(cli, tmp_path):
    """Two DDP ranks, a layer the loss never uses: one line naming dist.find_unused_parameters
    (DDP's own error names its constructor's argument), exit 2 through `submit --local`; with the
    key the run trains (two ranks by tests/launch.py: the route was proven by the refusal)."""
    unused = [*TINY, "task.target=testtasks:UnusedParameter", "cluster.tasks_per_node=2"]
    out = cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        *unused,
        f"run.dir={tmp_path}/a",
        "--local",
        env=TESTS_ENV,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout + out.stderr
    status = rundir.read_json(rundir.RunPaths(f"{tmp_path}/a").status, {})
    assert "the model has parameters that got no gradient" in status["error"], status
    assert "dist.find_unused_parameters=true" in status["error"], status
    with_key = [*unused, f"run.dir={tmp_path}/b", "dist.find_unused_parameters=true"]
    codes = launch.run(2, TINY_YAML, with_key, str(tmp_path / "logs"), env=TESTS_ENV)
    assert codes == [0, 0], open(rundir.RunPaths(f"{tmp_path}/b").log_file(0, 0)).read()[-3000:]
    assert os.path.exists(rundir.RunPaths(f"{tmp_path}/b").model)
