"""The docs keep working: relative links resolve, and the clusterflow commands they show parse."""

import os
import re
import shlex
import sys

import pytest
from clihelp import call
from conftest import REPO

from clusterflow.launch.submit import main as submit_main

# What a launcher sets for a job's processes; a submit starts with none of it (conftest.run_cli).
JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")
PAGES = [os.path.join(REPO, "README.md")] + [
    os.path.join(REPO, "docs", f)
    for f in sorted(os.listdir(os.path.join(REPO, "docs")))
    if f.endswith(".md")  # docs/images holds the pages' screenshots
]


@pytest.mark.parametrize("page", PAGES, ids=os.path.basename)
def test_relative_links_resolve(page):
    # Code blocks hold code, not links (an index such as f[:2](x) reads like one).
    text = re.sub(r"```.*?```", "", open(page).read(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)#\s]+)\)", text):
        if "://" in target:
            continue
        assert os.path.exists(os.path.join(os.path.dirname(page), target)), (
            f"{page}: broken link {target}"
        )


def commands():
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", open(page).read(), re.DOTALL):
            text = block.replace("\\\n", " ")
            for line in text.splitlines():
                for part in line.split("&&"):
                    part = part.strip()
                    if (
                        "clusterflow.submit" in part
                        and "--dry-run" not in part
                        and "mytask" not in part
                    ):
                        yield os.path.basename(page), part


@pytest.mark.parametrize("page,command", list(commands()))
def test_submit_commands_in_docs_parse_and_validate(monkeypatch, page, command):
    """Every `clusterflow.submit` line of the docs resolves its config (run as --dry-run). Called
    in this process, as ``python -m clusterflow.submit`` runs it from the repository
    (tests/clihelp.py): what is proven is the command's config and task, not a process start."""
    words = shlex.split(command.split("#")[0])
    at = words.index("clusterflow.submit")
    args = [a for a in words[at + 1 :] if a not in ("--local", "--wait")]
    # --dry-run before a script's own arguments (the words after --), which it must not join
    cut = args.index("--") if "--" in args else len(args)
    args = [*args[:cut], "--dry-run", *args[cut:]]
    monkeypatch.chdir(REPO)
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_")) or key in JOB_ENV:
            monkeypatch.delenv(key)
    # the command's own PYTHONPATH=... (a task module beside the config): submit imports it
    for word in words[:at]:
        if word.startswith("PYTHONPATH="):
            path = word.split("=", 1)[1]
            monkeypatch.setenv("PYTHONPATH", path)
            monkeypatch.syspath_prepend(os.path.join(REPO, path))
    environ, saved_path = dict(os.environ), list(sys.path)
    try:
        code, _, err = call(submit_main, args)
    finally:  # what the command would have changed in its own process only
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = saved_path
    assert code == 0, f"{page}: {command}\n{err}"
