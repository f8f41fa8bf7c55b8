"""`tf-psx export --verify DIR`: check an exported model against its manifest (tf_psx.trail)."""

from __future__ import annotations

from typing import Any

from tf_psx.cli.common import EXIT_OK
from tf_psx.errors import CommandError


def _add_export(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export",
        help="check an exported model against its manifest",
        description=(
            "With --verify DIR: recompute the SHA-256 of every file of the SavedModel that "
            "tf_psx.export_serving wrote to DIR and compare them with its tf_psx_manifest.json. Prints the "
            "content hash and the facts of the manifest, or each file that changed, is missing or was added "
            "(exit status 1)."
        ),
    )
    parser.add_argument("--verify", metavar="DIR", required=True, help="the exported model's directory")
    parser.set_defaults(run=_run_export)


def _run_export(args: Any) -> int:
    import json  # pylint: disable=import-outside-toplevel

    from tf_psx import trail  # pylint: disable=import-outside-toplevel

    try:
        manifest = trail.read_manifest(args.verify)
    except FileNotFoundError as error:
        raise CommandError(f"Option `--verify`: {error}") from None
    problems = trail.verify(args.verify)
    if problems:
        print(f"{args.verify}: does not match its manifest:")
        for problem in problems:
            print(f"  {problem}")
        return 1
    facts = {key: value for key, value in manifest.items() if key not in ("files", "content_hash")}
    print(f"{args.verify}: ok, content hash {manifest['content_hash']} ({len(manifest['files'])} files)")
    print(json.dumps(facts, sort_keys=True))
    return EXIT_OK
