"""Fuzz the command-line entry points with generated configs and overrides (tests/fuzzgen.py): for
every case `submit --dry-run` and `run --check` exit 0 or 2, never with a traceback, and a refusal
is exactly one `error:` line (issue 12).

Thousands of process starts would take an hour, so the mains are called in this process the way
`python -m` calls them (tests/clihelp.py); a few cases are then run as real processes to show
that the harness sees what a user sees. `run --check` stops where training would start: the
config, the run dir and the checkpoint dir, the saved config, the task's import, parameters and
dataset size are all checked by the same code a real run uses; a few valid cases are then trained
for real with plain `run`.
"""

import os
import subprocess
import sys

import pytest
from clihelp import call, one_error_line
from conftest import REPO
from fuzzgen import Gen

from clusterflow.job import run
from clusterflow.launch import submit

CASES = 1200
SEED = 12


def _outcome(main, path, overrides, extra):
    code, out, err = call(main, [path, *overrides, extra])
    return code, out, err


def _check(what, i, code, out, err):
    where = f"{what} case {i}"
    assert code in (0, 2), f"{where}: exit {code}\n{err[-3000:]}"
    assert "Traceback" not in out + err, f"{where}\n{err[-3000:]}"
    if code == 2:
        one_error_line(err)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """Every case with the outcome of `submit --dry-run` and `run --check`, run in a scratch cwd."""
    work = tmp_path_factory.mktemp("fuzz")
    old = os.getcwd()
    os.chdir(work)
    gen, results = Gen(SEED), []
    try:
        for i in range(CASES):
            data, overrides = gen.case()
            path = str(work / f"case{i}.yaml")
            with open(path, "wb") as f:
                f.write(data)
            dry = _outcome(submit.main, path, overrides, "--dry-run")
            check = _outcome(run.main, path, overrides, "--check")
            results.append((path, overrides, dry, check))
    finally:
        os.chdir(old)
    return work, results


def test_no_traceback_and_exit_0_or_2(fuzzed):
    work, results = fuzzed
    for i, (path, overrides, dry, check) in enumerate(results):
        _check("submit --dry-run", i, *dry)
        _check("run --check", i, *check)
        if dry[0] == 2 and not any(o.startswith("-") for o in overrides):
            assert check[0] == 2, (
                f"case {i}: submit refused, run did not\n{dry[2]}"
            )  # run checks more, never less
    assert not [p for p in os.listdir(work) if not p.startswith("case")], (
        "a dry run or a check wrote something"
    )
    accepted = sum(check[0] == 0 for *_, check in results)
    refused = sum(check[0] == 2 for *_, check in results)
    # The generator must exercise both sides, or this test proves nothing.
    assert accepted > CASES // 10 and refused > CASES // 2, (accepted, refused)


def _in_subprocess(module, path, overrides, extra, cwd):
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "tests")}
    args = [sys.executable, "-m", module, path, *(os.fsencode(o) for o in overrides), extra]
    out = subprocess.run(args, check=False, capture_output=True, cwd=cwd, env=env, timeout=120)
    return out.returncode, out.stdout.decode(errors="replace"), out.stderr.decode(errors="replace")


def _sample(results, which):
    """Some accepted and some refused cases, one with an override that is not UTF-8 if any."""
    ok = [r for r in results if r[which][0] == 0]
    bad = [r for r in results if r[which][0] == 2]
    odd = [r for r in bad if any("\udc80" <= c <= "\udcff" for o in r[1] for c in o)]
    return ok[:1] + bad[:1] + odd[:1]


@pytest.mark.parametrize(
    "module,which,extra",
    [("clusterflow.submit", 2, "--dry-run"), ("clusterflow.run", 3, "--check")],
)
def test_the_in_process_harness_matches_real_processes(fuzzed, module, which, extra):
    work, results = fuzzed
    sample = _sample(results, which)
    assert len(sample) == 3
    for path, overrides, *outcomes in sample:
        code, out, err = outcomes[which - 2]
        real = _in_subprocess(module, path, overrides, extra, work)
        assert real[0] == code, (path, overrides, real[2])
        if code == 2:
            assert one_error_line(real[2]) == one_error_line(err)
        else:
            assert real[1] == out and "Traceback" not in real[2]


def test_valid_cases_train_for_real(fuzzed, tmp_path):
    """Plain `run` on accepted cases: the check said it would start, and it does, and finishes."""
    work, results = fuzzed
    started = 0
    for path, overrides, dry, check in results:
        if (
            check[0] != 0
            or started == 2
            or "ok: testtasks:Tiny with 16 training samples" not in check[1]
        ):
            continue
        d = tmp_path / f"run{started}"
        code, _out, err = _in_subprocess(
            "clusterflow.run", path, [*overrides, f"run.dir={d}"], "train.epochs=1", work
        )
        assert code == 0 and "Traceback" not in err, (path, overrides, err[-3000:])
        started += 1
    assert started == 2
