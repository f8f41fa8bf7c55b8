"""Regenerates docs/benchmarks.md from bench/results/*.json."""

from __future__ import annotations

import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(os.path.dirname(HERE), "docs", "benchmarks.md")

HEADER = """# Benchmarks

Every number here comes from `make bench` (or one script in `bench/`), which
writes `bench/results/<name>.json`; this page is regenerated from those files
by `bench/report.py`. Speed targets are ratios measured side by side in one
run, so they hold on any machine; the absolute numbers are from the machine
named in each section.
"""


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render(records: list[dict]) -> str:
    parts = [HEADER]
    for rec in sorted(records, key=lambda r: r["name"]):
        parts.append(f"\n## {rec['name']}\n")
        parts.append(f"{rec['setup']}\n")
        parts.append(f"\nRan {rec['date']} on {rec['machine']}, TensorFlow {rec['tensorflow']}.\n")
        parts.append("\n| metric | value | target | met |\n|---|---|---|---|\n")
        for row in rec["rows"]:
            unit = f" {row['unit']}" if row.get("unit") else ""
            ok = row.get("ok")
            met = "yes" if ok is True else "no" if ok is False else "-"
            parts.append(f"| {row['metric']} | {_fmt(row['value'])}{unit} | {row.get('target') or '-'} | {met} |\n")
        for image in rec.get("images", []):
            parts.append(f"\n![{rec['name']}]({image})\n")
    return "".join(parts)


def main() -> None:
    records = []
    for path in sorted(glob.glob(os.path.join(HERE, "results", "*.json"))):
        with open(path, encoding="utf-8") as handle:
            records.append(json.load(handle))
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w", encoding="utf-8") as handle:
        handle.write(render(records))
    print(f"wrote {DOC} from {len(records)} result file(s)")


if __name__ == "__main__":
    main()
