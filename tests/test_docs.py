"""The docs keep working: relative links resolve, and the clusterflow commands they show parse."""

import os
import re
import shlex

import pytest
from conftest import REPO

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
def test_submit_commands_in_docs_parse_and_validate(cli, page, command):
    """Every `clusterflow.submit` line of the docs resolves its config (run as --dry-run)."""
    words = shlex.split(command.split("#")[0])
    at = words.index("clusterflow.submit")
    args = [a for a in words[at + 1 :] if a not in ("--local", "--wait")]
    # --dry-run before a script's own arguments (the words after --), which it must not join
    cut = args.index("--") if "--" in args else len(args)
    args = [*args[:cut], "--dry-run", *args[cut:]]
    # the command's own PYTHONPATH=... (a task module beside the config): submit imports it
    env = dict(w.split("=", 1) for w in words[:at] if w.startswith("PYTHONPATH="))
    out = cli("clusterflow.submit", *args, env=env or None)
    assert out.returncode == 0, f"{page}: {command}\n{out.stderr}"
