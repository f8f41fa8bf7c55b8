"""The layout rules of docs/architecture.md (unit tier: no cluster)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re

import pytest

import tf_psx
from tf_psx import errors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "tf_psx")
DOOR = os.path.join(PACKAGE, "_tf")
# os._exit ends a forked or signalled process without Python's exit handlers;
# a private member of tf_psx's own classes is marked "(tf_psx's own class)".
ALLOWED_PRIVATE = re.compile(r"os\._exit\(|\(tf_psx's own class\)")


def _sources():
    for root, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(root, name)


def test_every_module_in_the_architecture_page_imports():
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as handle:
        page = handle.read()
    names = sorted(set(re.findall(r"`(tf_psx(?:\.[a-z_]+)+)`", page)))
    assert len(names) >= 20, names
    for name in names:
        importlib.import_module(name)
    # And every module of the package is on the page.
    for path in _sources():
        module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        if module.endswith("__init__") or module.startswith("tf_psx.data."):
            continue
        assert f"`{module}`" in page, f"{module} is not described in docs/architecture.md"


def test_private_tf_apis_only_behind_the_door():
    offenders = []
    for path in _sources():
        if path.startswith(DOOR + os.sep):
            continue
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                code = line.split("#", 1)[0]
                if re.search(r"(from|import) tensorflow\.python", code) or (
                    "protected-access" in line and not ALLOWED_PRIVATE.search(line)
                ):
                    offenders.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not offenders, "private TF access outside tf_psx/_tf:\n" + "\n".join(offenders)


def _imported_tf_psx_modules(path: str) -> set[str]:
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tf_psx"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("tf_psx"))
    return found


def test_the_door_depends_on_nothing_public_but_errors():
    public = {f"tf_psx.{name[:-3]}" for name in os.listdir(PACKAGE) if name.endswith(".py") and not name.startswith("_")}
    public |= {"tf_psx.data"}
    for name in os.listdir(DOOR):
        if name.endswith(".py"):
            used = _imported_tf_psx_modules(os.path.join(DOOR, name)) & public
            assert used <= {"tf_psx.errors"}, f"tf_psx/_tf/{name} imports {sorted(used)}"


def test_every_public_error_is_a_tfpsx_error():
    classes = [obj for _, obj in inspect.getmembers(errors, inspect.isclass) if issubclass(obj, Exception)]
    assert len(classes) >= 10
    for cls in classes:
        assert issubclass(cls, errors.TFPSXError), cls
        assert cls is errors.TFPSXError or any(
            issubclass(cls, builtin) for builtin in (ValueError, TypeError, RuntimeError, OSError)
        ), cls
    for name in ("TFConfigError", "LocalResourcesError", "Keras3Error", "ClusterUnreachableError"):
        assert getattr(tf_psx, name) is getattr(errors, name)


@pytest.mark.parametrize("module", ["tf_psx.cluster", "tf_psx.errors", "tf_psx.cluster.k8s", "tf_psx.cli", "tf_psx.snapshots", "tf_psx.netproxy", "tf_psx.metrics", "tf_psx.stalls", "tf_psx.cluster.preflight", "tf_psx.cluster.ports", "tf_psx.launch", "tf_psx.redaction"])
def test_light_modules_do_not_import_tensorflow(module):
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    code = f"import sys, {module}; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
