"""The version trail of an exported model: a manifest beside the SavedModel, and its check.

`tf_psx.export_serving(..., metadata=...)` writes `tf_psx_manifest.json`
into the SavedModel directory once the model is complete. It holds:

* `files`: the SHA-256 of every file of the SavedModel (paths relative to
  it, the manifest itself excluded), and `content_hash`: the SHA-256 of that
  sorted list, one value that names these files (TF writes a new graph on
  every save, so two exports of the same weights have different hashes);
* `versions`: Python, TensorFlow, tf-keras, TFRA (when installed) and tf_psx;
* `created`: the UTC time of the export;
* what the caller passes: the snapshot the weights came from (`step`,
  `path`), the data position, metrics at export, or anything else that is
  JSON.

`verify(path)` (and `tf-psx export --verify DIR`) recomputes the hashes
and names every file that changed, is missing or was added. This module
reads files through `tf.io.gfile` only for paths with a scheme (gs://);
local paths need no TensorFlow.

`next_version(base)` is the integer after the largest numeric directory of
`base`: `export_serving(model, f"{base}/{next_version(base)}")` gives TF
Serving's `NAME/VERSION/` layout, which it reloads when a new version
appears.

Example:

>>> import os, tempfile
>>> base = tempfile.mkdtemp()
>>> next_version(base)
1
>>> model = os.path.join(base, "1")
>>> os.makedirs(os.path.join(model, "variables"))
>>> with open(os.path.join(model, "saved_model.pb"), "wb") as handle:
...     _ = handle.write(b"graph")
>>> manifest = write_manifest(model, {"step": 1200, "metrics": {"auc": 0.71}})
>>> verify(model) == [] and manifest["step"] == 1200 and next_version(base)
2
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform

from tf_psx import snapshots as _snapshots
from tf_psx.errors import ArgumentError, MissingFileError

__all__ = ["MANIFEST_NAME", "check_metadata", "write_manifest", "read_manifest", "verify", "next_version", "package_versions"]

MANIFEST_NAME = "tf_psx_manifest.json"
_CHUNK = 1 << 20


def _fs(path: str):
    return _snapshots.filesystem(path)


def _walk(path: str) -> list[str]:
    """Every file under `path`, relative to it, '/'-separated, sorted (the manifest left out)."""
    if _snapshots.is_local(path):
        found = []
        for root, _dirs, files in os.walk(path):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), path).replace(os.sep, "/")
                found.append(rel)
    else:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        found = []
        for root, _dirs, files in tf.io.gfile.walk(path):
            for name in files:
                full = f"{root.rstrip('/')}/{name}"
                found.append(full[len(path.rstrip("/")) + 1:])
    return sorted(name for name in found if name != MANIFEST_NAME)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    if _snapshots.is_local(path):
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(_CHUNK), b""):
                digest.update(block)
    else:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        with tf.io.gfile.GFile(path, "rb") as handle:
            for block in iter(lambda: handle.read(_CHUNK), b""):
                digest.update(block)
    return digest.hexdigest()


def _hashes(path: str) -> dict[str, str]:
    fs = _fs(path)
    return {name: _sha256(fs.join(path, *name.split("/"))) for name in _walk(path)}


def _content_hash(files: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{name}\0{files[name]}\n" for name in sorted(files)).encode()).hexdigest()


def package_versions() -> dict[str, str | None]:
    """The versions of what the model was built with (None for a package that is not installed)."""
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "tensorflow": version("tensorflow"), "tf_keras": version("tf-keras"),
            "tensorflow_recommenders_addons": version("tensorflow-recommenders-addons"), "tf_psx": tf_psx.__version__}


def check_metadata(metadata) -> dict:
    """`metadata` as a dict of JSON values that sets no key the manifest writes; else ValueError."""
    if metadata is not None and not isinstance(metadata, dict):
        raise ArgumentError(f"Argument `metadata` must be a dict or None. Received: {metadata!r}. Fix: pass e.g. "
                            "metadata={\"step\": 1200, \"metrics\": {\"auc\": 0.79}}.")
    metadata = dict(metadata or {})
    reserved = sorted({"files", "content_hash", "versions", "created", "format"} & set(metadata))
    if reserved:
        raise ArgumentError(f"Argument `metadata` must not set {reserved}: the manifest writes them. Received keys: "
                            f"{sorted(metadata)}. Fix: rename those keys.")
    try:
        json.dumps(metadata)
    except TypeError as error:
        raise ArgumentError(f"Argument `metadata` must hold JSON values only. Received: {metadata!r} ({error}). "
                            "Fix: convert numpy numbers and tensors with float() / int() / .tolist().") from error
    return metadata


def write_manifest(path: str, metadata: dict | None = None) -> dict:
    """Writes `path`/tf_psx_manifest.json for the files now in `path`; returns the manifest.

    Args:
      path: a complete SavedModel directory.
      metadata: JSON-serialisable facts to keep (snapshot step and path, data
        position, metrics...). Keys that the manifest sets itself
        (`files`, `content_hash`, `versions`, `created`) are not allowed.

    Raises:
      ValueError: `metadata` is not a dict of JSON values, or uses a reserved key.
    """
    metadata = check_metadata(metadata)
    files = _hashes(path)
    manifest = {
        "format": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **metadata,
        "versions": package_versions(),
        "files": files,
        "content_hash": _content_hash(files),
    }
    fs = _fs(path)
    fs.write_text(fs.join(path, MANIFEST_NAME), json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def read_manifest(path: str) -> dict:
    """The manifest of the export at `path`.

    Raises:
      FileNotFoundError: no manifest there (exported without one, or not an export).
    """
    fs = _fs(path)
    name = fs.join(path, MANIFEST_NAME)
    if fs.exists(path) and not fs.isdir(path):
        kind = "a Keras model file" if str(path).endswith((".keras", ".h5")) else "a file"
        raise MissingFileError(
            f"{path} is {kind}, not the directory tf_psx.export_serving writes (a SavedModel with "
            f"{MANIFEST_NAME}). Fix: export it with tf_psx.export_serving(tf.keras.models.load_model({str(path)!r}), "
            "'export_dir'), then verify 'export_dir'.")
    if not fs.exists(name):
        raise MissingFileError(f"{name} does not exist: {path} was not exported by tf_psx.export_serving with a "
                               "manifest. Fix: export it again with export_serving(model, path).")
    return json.loads(fs.read_text(name))


def verify(path: str) -> list[str]:
    """The differences between the export at `path` and its manifest; [] when it is intact.

    Each difference is one line naming a file: changed, missing or not in
    the manifest. A manifest whose `content_hash` does not match its own
    file list is reported too.
    """
    manifest = read_manifest(path)
    expected = manifest.get("files", {})
    problems = []
    if _content_hash(expected) != manifest.get("content_hash"):
        problems.append("the manifest's content_hash does not match its own list of files (the manifest was edited)")
    actual = _hashes(path)
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            problems.append(f"missing: {name}")
        elif name not in expected:
            problems.append(f"not in the manifest: {name}")
        elif actual[name] != expected[name]:
            problems.append(f"changed: {name}")
    return problems


def next_version(base: str) -> int:
    """1 + the largest numeric subdirectory of `base` (1 when there is none): TF Serving's next version."""
    fs = _fs(base)
    if not fs.isdir(base):
        return 1
    versions = [int(name) for name in fs.listdir(base) if name.isdigit()]
    return max(versions, default=0) + 1
