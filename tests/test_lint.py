"""Lint as a contract: ``ruff check`` and ``ruff format --check`` are clean over every file of the
repository, with the rule set pyproject.toml chooses, and ruff looks at every Python file git
tracks (a folder ruff excludes by default, such as one named ``dist`` or ``build``, would hide a
package from both)."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]' installs the pinned version")
    return subprocess.run(
        [exe, *args], check=False, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_ruff_check_is_clean_over_every_file():
    out = ruff("check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_check_is_clean_over_every_file():
    out = ruff("format", "--check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_looks_at_every_python_file_git_tracks():
    listed = ruff("check", "--show-files", ".")
    assert listed.returncode == 0, listed.stderr
    seen = {os.path.relpath(p, REPO) for p in listed.stdout.split() if p.endswith(".py")}
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], check=True, cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    if not tracked:
        pytest.fail("git ls-files lists no Python file: run the suite from a git checkout")
    missed = sorted(set(tracked) - seen)
    assert not missed, f"ruff never looks at {len(missed)} tracked file(s): {missed[:20]}"
