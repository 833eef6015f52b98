"""The README's Python blocks run as written, and the links of the README and docs/ resolve.

Each ```python block of README.md runs as its own script (a reader copies one block at a time;
the multi-process block needs to be a script so that ``ssmshard.launch`` can start it). The
blocks check themselves against Hugging Face (``assert``); this test checks that they exit 0 and
print what the README says they print.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")


def python_blocks(path: str) -> list[str]:
    with open(path) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)


# What each block prints (in order): the program summary and plan; the sharding report; the pass.
EXPECTED_OUTPUT = ["mamba2 forward program", "sync points", "scan nodes, one per layer"]


def test_readme_has_the_blocks_this_test_knows():
    assert len(python_blocks(README)) == len(EXPECTED_OUTPUT)


@pytest.mark.parametrize("index", range(len(EXPECTED_OUTPUT)))
def test_readme_python_block_runs(index, tmp_path):
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(python_blocks(README)[index])
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert EXPECTED_OUTPUT[index] in run.stdout, run.stdout[-3000:]


def test_links_in_readme_and_docs_resolve():
    pages = [README] + [os.path.join(REPO, "docs", n) for n in os.listdir(os.path.join(REPO, "docs")) if n.endswith(".md")]
    pages += [os.path.join(root, "README.md") for root, _, files in os.walk(os.path.join(REPO, "benchmarks", "results"))
              if "README.md" in files]
    broken = []
    for page in pages:
        with open(page) as f:
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read()):
                if "://" not in target and not os.path.exists(os.path.join(os.path.dirname(page), target)):
                    broken.append(f"{os.path.relpath(page, REPO)} -> {target}")
    assert not broken, broken
