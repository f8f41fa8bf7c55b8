"""The docs site builds in strict mode, and every ```python block in the docs runs.

Code blocks run page by page: the blocks of one page, in order, form one
script (a page is a tutorial whose blocks build on each other), run in a
fresh process in an empty directory. A page whose code starts a cluster is
marked `processes`, like the examples. Only ```python blocks run; shell
blocks (```, ```bash) show commands for a real machine.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, SCRIPT_TIMEOUT_S

DOCS = os.path.join(REPO, "docs")
PAGES = sorted(glob.glob(os.path.join(DOCS, "*.md")) + glob.glob(os.path.join(DOCS, "guides", "*.md")))
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# Code that connects to a cluster (in-process servers in the page's process).
_NEEDS_CLUSTER = re.compile(r"LocalCluster\(|ParameterServerStrategy\(")
# The pages the issue asks for; mkdocs.yml must list each one.
REQUIRED_PAGES = [
    "index.md", "concepts.md", "guides/partitioning.md", "guides/staleness.md", "guides/fault_tolerance.md",
    "guides/kubernetes.md", "guides/monitoring.md", "security.md", "benchmarks.md", "api.md",
]


def _blocks(page: str) -> list[str]:
    with open(page, encoding="utf-8") as handle:
        return _PYTHON_BLOCK.findall(handle.read())


def _page_params():
    params = []
    for page in PAGES:
        blocks = _blocks(page)
        if not blocks:
            continue
        marks = [pytest.mark.processes] if any(_NEEDS_CLUSTER.search(b) for b in blocks) else []
        params.append(pytest.param(page, id=os.path.relpath(page, DOCS), marks=marks))
    return params


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def _config() -> dict:
    with open(os.path.join(REPO, "mkdocs.yml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def test_nav_lists_every_required_page_and_every_page_exists():
    config = _config()
    nav = _nav_pages(config["nav"])
    assert config["strict"] is True
    assert sorted(set(REQUIRED_PAGES) - set(nav)) == []
    missing = [page for page in nav if not os.path.exists(os.path.join(DOCS, page))]
    assert missing == []
    on_disk = sorted(os.path.relpath(p, DOCS) for p in PAGES)
    assert sorted(set(on_disk) - set(nav)) == []  # no page the reader cannot reach


def test_docs_build_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True, text=True, cwd=REPO, timeout=SCRIPT_TIMEOUT_S, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for page in _nav_pages(_config()["nav"]):
        html = site / (page[: -len(".md")] + "/index.html" if page != "index.md" else "index.html")
        assert html.exists(), html
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    # Rendered from the docstrings, doctests as code (not as Markdown quotes).
    for name in ("tf_psx.strategies.ParameterServerStrategy", "tf_psx.export.export_serving",
                 "tf_psx.layers.DynamicEmbedding", "tf_psx.data.criteo.criteo"):
        assert f'id="{name}"' in api, name
    assert "language-pycon" in api
    assert "&gt;&gt;&gt;" not in re.sub(r"<code.*?</code>", "", api, flags=re.S)


def test_griffe_extension_fences_doctests_only_outside_fences():
    spec = importlib.util.spec_from_file_location("griffe_extensions", os.path.join(DOCS, "griffe_extensions.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "Example:\n\n>>> f([1])\n[4, 8]\n\nAfter.\n\n```python\n>>> kept\n```"
    assert module.fence_doctests(text) == (
        "Example:\n\n```pycon\n>>> f([1])\n[4, 8]\n```\n\nAfter.\n\n```python\n>>> kept\n```"
    )


def test_every_page_with_code_has_its_code_tested():
    # The guides must show code; a page that loses its blocks stops being tested.
    with_code = {os.path.relpath(p, DOCS) for p in PAGES if _blocks(p)}
    assert {"index.md", "concepts.md", "guides/partitioning.md"} <= with_code


@pytest.mark.parametrize("page", _page_params())
def test_python_blocks_of_the_page_run(page, tmp_path):
    code = "\n\n".join(_blocks(page))
    script = tmp_path / "page.py"
    # In-process servers cannot be stopped (TF 2.16): leave without waiting on them.
    script.write_text(code + "\n\nimport os as _os, sys as _sys\n_sys.stdout.flush(); _sys.stderr.flush(); _os._exit(0)\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=SCRIPT_TIMEOUT_S, cwd=tmp_path, env=env, check=False)
    assert result.returncode == 0, f"{page}:\n" + result.stdout[-3000:] + result.stderr[-3000:]
