"""The `clusterflow` console script offers every command, and a command whose reader goes away
early (`| head -1`) ends quietly: no traceback, exit 141 (128 + SIGPIPE, as the shell reports)."""

import os
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

SCRIPT = os.path.join(os.path.dirname(sys.executable), "clusterflow")
EXIT_BROKEN_PIPE = 141


def env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}


def script(*args):
    if not os.path.exists(SCRIPT):
        pytest.skip(f"no console script at {SCRIPT} (pip install -e . puts it there)")
    return subprocess.run(
        [SCRIPT, *args],
        check=False,
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def run_dir(tiny_one_process_model):
    return os.path.dirname(tiny_one_process_model)


@pytest.mark.parametrize(
    "cmd,flag", [("logs", "--rank"), ("cancel", "RUN_DIR|SWEEP_DIR"), ("check", "--steps N")]
)
def test_the_console_script_shows_each_commands_help(cmd, flag):
    out = script(cmd, "--help")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("usage: ") and f"clusterflow.{cmd}" in out.stdout
    assert flag in out.stdout and "examples:" in out.stdout and out.stderr == ""


def test_no_command_prints_usage_naming_every_command_and_exits_2():
    out = run_cli("clusterflow.cli")
    assert out.returncode == 2
    for cmd in ("submit", "run", "status", "logs", "cancel"):
        assert f"  clusterflow {cmd} " in out.stdout, out.stdout
    assert "Traceback" not in out.stderr


def test_an_unknown_command_names_the_choices():
    out = run_cli("clusterflow.cli", "stats")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown command 'stats'; choose one of submit, run, status, logs, cancel" in out.stderr


def test_the_console_script_runs_logs_and_status(run_dir):
    out = script("logs", run_dir)
    assert out.returncode == 0 and "==> " in out.stdout, out.stdout + out.stderr
    out = script("status", run_dir)
    assert out.returncode == 0 and "completed" in out.stdout, out.stdout + out.stderr


def quiet(stderr):
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert "Exception ignored" not in stderr, stderr


@pytest.mark.parametrize("argv", [["status"], ["status", "--json"], ["logs"]], ids=" ".join)
def test_a_pipe_to_head_ends_quietly(run_dir, argv):
    """`python -m clusterflow.status RUN_DIR | head -1`: one line, no traceback."""
    cmd, rest = argv[0], argv[1:]
    line = (
        f"set -o pipefail; {sys.executable} -m clusterflow.{cmd} {run_dir} {' '.join(rest)} "
        f"| head -1"
    )
    out = subprocess.run(
        ["bash", "-c", line],
        check=False,
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    quiet(out.stderr)
    # 0 when the whole output was written before head left, 141 when head left first.
    assert out.returncode in (0, EXIT_BROKEN_PIPE) and len(out.stdout.splitlines()) == 1, out


CLOSED_EARLY = [
    ["clusterflow.status"],
    ["clusterflow.status", "--json"],
    ["clusterflow.cli", "status"],
    ["clusterflow.logs"],
]


@pytest.mark.parametrize("argv", CLOSED_EARLY, ids=" ".join)
def test_a_reader_gone_before_the_first_write_ends_quietly(run_dir, argv):
    """The reader closes its end at once, so the command's first write fails, every time."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv, run_dir],
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()
    stderr = proc.stderr.read()
    code = proc.wait(timeout=120)
    quiet(stderr)
    # `logs` handles its own closed pipe and ends with 0; every other command with 141.
    assert code == (0 if argv[0] == "clusterflow.logs" else EXIT_BROKEN_PIPE), (code, stderr)


def test_a_broken_pipe_that_is_not_stdout_keeps_its_traceback():
    """Only a closed stdout is quiet: a BrokenPipeError from another pipe is a real error."""
    code = (
        "import sys\nfrom clusterflow.errors import cli\n\n@cli\ndef main(argv):\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n\nsys.exit(main([]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "BrokenPipeError" in out.stderr, out.stdout + out.stderr
