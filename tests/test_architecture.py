"""The layout rules of docs/architecture.md (unit tier: no cluster)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import sys

import pytest

import tf_psx
from tf_psx import errors

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "tf_psx")
DOOR = os.path.join(PACKAGE, "_tf")
# os._exit ends a forked or signalled process without Python's exit handlers;
# a private member of tf_psx's own classes is marked "(tf_psx's own class)".
ALLOWED_PRIVATE = re.compile(r"os\._exit\(|\(tf_psx's own class\)")


def _sources(package: str = PACKAGE):
    for root, _dirs, files in os.walk(package):
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


@pytest.mark.processes
@pytest.mark.parametrize("module", ["tf_psx.cluster", "tf_psx.errors", "tf_psx.cluster.k8s", "tf_psx.cli", "tf_psx.snapshots", "tf_psx.netproxy", "tf_psx.metrics", "tf_psx.training.stalls", "tf_psx.cluster.preflight", "tf_psx.cluster.ports", "tf_psx.launch", "tf_psx.redaction"])
def test_light_modules_do_not_import_tensorflow(module):
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    code = f"import sys, {module}; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


# -- the error rule -------------------------------------------------------------
#
# Every `raise` in tf_psx/ raises a tf_psx.errors.TFPSXError (each of which is
# also the built-in it refines), except for these, which are not errors of tf_psx:
ALLOWED_RAISES = {
    "StopIteration": "the iterator protocol (an iterator's end), not an error",
    "AttributeError": "the attribute protocol: only inside a `__getattr__` (a module's, PEP 562, or a class's)",
    "NotImplementedError": "an abstract method: only as the whole body of a method that subclasses override",
    "KeyboardInterrupt": "process control, not an error",
    "SystemExit": "process control, not an error",
}
# Also allowed, checked below: a bare `raise`; `raise err` / `raise self.error` /
# `raise failures[0]` (re-raising an exception object caught or received from
# elsewhere, e.g. TF's own error, unchanged); TF's `tf.errors.OpError` classes
# (the eager twin of a graph-mode `tf.debugging.Assert`, which raises that
# class, so both modes raise the same error); private control-flow classes
# defined in tf_psx (`_Name`), raised and caught in the same module; a call of
# a parameter whose default is a TFPSXError (`raise error(message)` in
# `_checks.int_at_least`); and a call of a function annotated to return one
# (`raise _address_error(...)`).


def _module_name(path: str, repo: str | None = None) -> str:
    name = os.path.relpath(path, repo or REPO)[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _parents(tree: ast.AST) -> dict:
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    return parents


def _enclosing_function(node, parents):
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return None


def _function_object(module, function: ast.FunctionDef, parents):
    """The module-level function or the method of a module-level class that `function` defines (None if nested)."""
    outer = parents.get(function)
    if isinstance(outer, ast.Module):
        return getattr(module, function.name, None)
    if isinstance(outer, ast.ClassDef) and isinstance(parents.get(outer), ast.Module):
        return getattr(getattr(module, outer.name, None), function.name, None)
    return None


def _local_imports(tree: ast.AST) -> dict:
    """Names bound by imports anywhere in the module (function-level ones too): name -> (module, attribute)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                bound[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):  # `import a.b` binds a; `import a.b as x` binds x to a.b
            for alias in node.names:
                module = alias.name if alias.asname else alias.name.split(".")[0]
                bound[alias.asname or module] = (module, None)
    return bound


_MISSING = object()


def _resolve(expression: ast.expr, module, imports: dict):
    """The object a Name / dotted Attribute names in `module` (function-level imports included), or _MISSING."""
    import builtins  # pylint: disable=import-outside-toplevel

    parts = []
    while isinstance(expression, ast.Attribute):
        parts.insert(0, expression.attr)
        expression = expression.value
    if not isinstance(expression, ast.Name):
        return _MISSING
    name = expression.id
    if hasattr(module, name):
        value = getattr(module, name)
    elif name in imports:
        source, attribute = imports[name]
        value = importlib.import_module(source)
        if attribute is not None:
            value = getattr(value, attribute, _MISSING)
            if value is _MISSING:
                value = importlib.import_module(f"{source}.{attribute}")
    elif hasattr(builtins, name):
        value = getattr(builtins, name)
    else:
        return _MISSING
    for part in parts:
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


def _is_tf_op_error(cls) -> bool:
    if not cls.__module__.startswith("tensorflow."):
        return False
    return issubclass(cls, importlib.import_module("tensorflow").errors.OpError)


def _raise_offence(node: ast.Raise, module, source: str, parents: dict, imports: dict) -> str | None:
    """Why this raise breaks the error rule, or None when it keeps it."""
    if node.exc is None:
        return None  # bare `raise`: re-raises the exception being handled
    call = isinstance(node.exc, ast.Call)
    target = node.exc.func if call else node.exc
    if not isinstance(target, (ast.Name, ast.Attribute)):
        return None if not call else f"cannot resolve `{ast.unparse(target)}`"  # `raise failures[0]`: an object
    value = _resolve(target, module, imports)
    function = _enclosing_function(node, parents)
    if value is _MISSING:
        if not call:
            return None  # `raise err`, `raise self.error`: an exception object caught or received from elsewhere
        if isinstance(target, ast.Name) and function is not None and target.id in {
                arg.arg for arg in function.args.args + function.args.kwonlyargs}:
            owner = _function_object(module, function, parents)
            default = inspect.signature(owner).parameters[target.id].default if owner else None
            if isinstance(default, type) and issubclass(default, errors.TFPSXError):
                return None  # `raise error(message)`, `error` defaulting to a TFPSXError
            return f"`{target.id}` is a parameter whose default ({default!r}) is not a TFPSXError"
        return f"cannot resolve `{ast.unparse(target)}`"
    if isinstance(value, BaseException) and not call:
        value = type(value)  # a module-level exception object: judged by its class
    if not isinstance(value, type):
        hints = getattr(value, "__annotations__", {})
        returned = hints.get("return")
        if isinstance(returned, str):
            returned = eval(returned, value.__globals__)  # pylint: disable=eval-used  (the function's own annotation)
        if isinstance(returned, type) and issubclass(returned, errors.TFPSXError):
            return None  # `raise _spec_error(...)`: a function returning a TFPSXError
        return f"`{ast.unparse(target)}` is a function not annotated to return a TFPSXError"
    if issubclass(value, errors.TFPSXError):
        return None
    name = value.__name__
    if name in ALLOWED_RAISES and getattr(__import__("builtins"), name, None) is value:
        if name == "AttributeError" and (function is None or function.name != "__getattr__"):
            return "AttributeError outside a `__getattr__`"
        if name == "NotImplementedError":
            body = function.body if function else []
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            if body != [node]:
                return "NotImplementedError outside an abstract method (a method whose whole body is the raise)"
        return None
    if _is_tf_op_error(value):
        return None
    if name.startswith("_") and value.__module__ == module.__name__:
        if re.search(rf"except\s*\(?[^:\n]*\b{re.escape(name)}\b", source):
            return None  # private control flow, caught in the same module
        return f"the private class {name} is never caught in its module"
    return f"{value.__module__}.{name} is not a tf_psx.errors.TFPSXError"


def _raise_offenders(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    tree = ast.parse(source)
    module = importlib.import_module(_module_name(path))
    parents, imports = _parents(tree), _local_imports(tree)
    found = []
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Raise)), key=lambda n: n.lineno):
        why = _raise_offence(node, module, source, parents, imports)
        if why:
            found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {why}: {ast.unparse(node)[:100]}")
    return found


def test_every_deliberate_raise_is_a_tfpsx_error():
    offenders = [line for path in sorted(_sources()) for line in _raise_offenders(path)]
    assert not offenders, ("raises that break the error rule (use a tf_psx.errors class, e.g. ArgumentError "
                           "for a ValueError; see docs/architecture.md):\n" + "\n".join(offenders))


def test_the_error_rule_test_catches_a_builtin_raise(tmp_path, monkeypatch):
    # The check above, on a module that breaks the rule in each way it knows.
    package = tmp_path / "rule_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bad.py").write_text(
        "import tf_psx.errors as errors\n"
        "class _Private(Exception):\n    pass\n"
        "def f(x):\n"
        "    if x == 1:\n        raise ValueError('bad')\n"
        "    if x == 2:\n        raise AttributeError('not in __getattr__')\n"
        "    if x == 3:\n        raise _Private()\n"
        "    if x == 4:\n        raise errors.ArgumentError('fine')\n"
        "    try:\n        pass\n    except OSError as err:\n        raise err\n"
        "def g(message, error=TypeError):\n    raise error(message)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    found = _raise_offenders(str(package / "bad.py"))
    assert [line.split(":")[1] for line in found] == ["6", "8", "10", "18"], found
    assert "builtins.ValueError is not a tf_psx.errors.TFPSXError" in found[0]


def test_checks_default_to_a_tfpsx_error():
    from tf_psx import _checks  # pylint: disable=import-outside-toplevel

    defaults = {
        name: parameter.default
        for name, function in inspect.getmembers(_checks, inspect.isfunction)
        for parameter in inspect.signature(function).parameters.values()
        if parameter.name == "error"
    }
    assert defaults, "tf_psx._checks has no function with an `error` parameter"
    for name, default in defaults.items():
        assert issubclass(default, errors.ArgumentError), f"_checks.{name}(error=...) defaults to {default!r}"
    with pytest.raises(errors.ArgumentError, match="Argument `n` must be an int >= 1"):
        _checks.int_at_least(0, 1, "n")


def test_the_general_errors_refine_their_builtins():
    expected = {
        "ArgumentError": ValueError, "ArgumentTypeError": TypeError, "StateError": RuntimeError,
        "DataError": ValueError, "MissingFileError": FileNotFoundError, "PathExistsError": FileExistsError,
        "NetworkSetupError": OSError,
    }
    for name, builtin in expected.items():
        cls = getattr(errors, name)
        assert issubclass(cls, errors.TFPSXError) and issubclass(cls, builtin), name
        assert name in errors.__all__, name
    assert set(errors.__all__) == {name for name, obj in vars(errors).items()
                                   if isinstance(obj, type) and issubclass(obj, Exception)}
    error = errors.NetworkSetupError(98, "cannot listen")  # the OS errno is kept
    assert (error.errno, str(error)) == (98, "[Errno 98] cannot listen")
    assert tf_psx.ArgumentError is errors.ArgumentError


# -- no import loop -----------------------------------------------------------
#
# The graph: an edge A -> B when running module A's import statements may run
# module B's body, counting function-level (lazy) imports as if they ran at
# import time, and leaving out `if TYPE_CHECKING:` blocks (they never run).
# `import P.Q.R` and `from P.Q import R` give an edge to each package on the
# way (P.Q's __init__ runs) and to R when R is a module. A package that
# contains A is left out when the import only names a submodule of it (or is
# the package on the way to one): Python runs a package's __init__ before any
# module in it, so that is the normal parent-package import, not a loop. When
# A takes a *name* from a package containing it (`from tf_psx.cluster import
# ClusterConfig` in tf_psx.cluster.tlsmesh) the edge counts: that name exists
# only once the __init__ has run far enough.
# `tf_psx/__init__.py` maps its public names to modules lazily (`_EXPORTS`,
# `_SUBMODULES`, loaded by `importlib` in `__getattr__` on first attribute
# access, after the package has been imported): those are not edges. Its own
# import statements (`_quiet`, `_tf.keras`) are.


def _under_type_checking(node, parents) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _import_graph(package: str = PACKAGE) -> dict[str, set[str]]:
    root = os.path.dirname(package)
    top = os.path.basename(package)
    modules = {_module_name(path, root): path for path in _sources(package)}
    packages = {_module_name(path, root) for path in _sources(package) if path.endswith("__init__.py")}

    def containing(module: str, package: str) -> bool:
        return module.startswith(package + ".") or (module == package and module in packages)

    graph = {name: set() for name in modules}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        parents = _parents(tree)
        own_package = name if name in packages else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or _under_type_checking(node, parents):
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package of this module
                    base = ".".join(own_package.split(".")[: len(own_package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [(base, [alias.name for alias in node.names])]
            else:
                targets = [(alias.name, []) for alias in node.names]
            for base, names in targets:
                if base != top and not base.startswith(top + "."):
                    continue
                parts = base.split(".")
                chain = [".".join(parts[: i + 1]) for i in range(len(parts))]
                submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
                takes_names = len(submodules) < len(names) or not names
                for step in chain:
                    if step not in modules:
                        continue
                    if containing(name, step) and not (step == base and takes_names and names):
                        continue  # the parent-package import
                    graph[name].add(step)
                graph[name].update(submodules)
        graph[name].discard(name)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_no_import_cycle():
    graph = _import_graph()
    assert len(graph) >= 60 and sum(len(edges) for edges in graph.values()) >= 100, graph
    assert "tf_psx.errors" in graph["tf_psx._checks"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_import_graph_finds_a_lazy_cycle(tmp_path):
    files = {
        "__init__.py": "from pkg import a\n",
        "a.py": "from pkg import b\n",
        "b.py": "def later():\n    from pkg.sub import c  # a lazy import counts\n",
        "sub/__init__.py": "",
        "sub/c.py": "from pkg.sub import d\nfrom pkg import a\n",  # sub is c's parent: not an edge
        "sub/d.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg import b\n",  # never runs: not an edge
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = _import_graph(str(tmp_path / "pkg"))
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub", "pkg.sub.c"}, "pkg.sub": set(),
                     "pkg.sub.c": {"pkg.sub.d", "pkg.a"}, "pkg.sub.d": set()}, graph
    assert _find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.processes
def test_moved_modules_import_by_their_old_names():
    """`tf_psx.stalls`, `tf_psx.exact_updates`, ... moved into packages: the old names are the same module objects."""
    import subprocess  # pylint: disable=import-outside-toplevel

    code = ("import sys, tf_psx, tf_psx.stalls, tf_psx.training.stalls\n"
            "from tf_psx import step_once\n"
            "from tf_psx.training import step_once as moved\n"
            "assert tf_psx.stalls is tf_psx.training.stalls and step_once is moved\n"
            "assert sys.modules['tf_psx.stalls'] is tf_psx.training.stalls\n"
            "import tf_psx.exact_tables, tf_psx.tables.tfra_updates\n"
            "assert tf_psx.exact_tables is tf_psx.tables.tfra_updates\n"
            "assert callable(tf_psx.exact_updates.rerun_counts)\n"
            "try:\n    import tf_psx.no_such_module\nexcept ImportError:\n    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "refused"


def test_fewer_than_16_top_level_modules():
    top = sorted(name for name in os.listdir(PACKAGE) if name.endswith(".py") and name != "__init__.py")
    assert len(top) < 16, top
