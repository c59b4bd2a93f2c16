"""``python -m fedderm.ledger import|render|verify`` (see :mod:`fedderm.ledger`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedderm.ledger import LedgerError, default_root


def _sets(items: list[str] | None) -> dict:
    import tomllib

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise LedgerError(f"--set {item!r}: KEY=VALUE (a TOML value)")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            raise LedgerError(
                f"--set {item!r}: {value!r} is not a TOML value (strings need quotes)"
            ) from None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedderm.ledger", description=__doc__)
    parser.add_argument("--root", type=Path, default=None, help="repository root (default: here)")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a sweep folder -> ledger/records/<id>/")
    imp.add_argument("folder", help="the sweep's --out folder (run folders, table.json)")
    imp.add_argument("--sweep-file", required=True, help="the sweep file it ran (as at the commit it ran)")
    imp.add_argument("--quick", action="store_true", help="it ran with --quick")
    imp.add_argument("--gpu", action="store_true", help="it ran with --gpu")
    imp.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="the --set it ran with")
    imp.add_argument("--seeds", help="the --seeds it ran with (comma-separated)")
    imp.add_argument("--name", help="record id (default: the file's name, -quick, -gpu)")
    imp.add_argument("--commit", help="the commit it ran at (when the folder has no provenance.json)")
    imp.add_argument("--machine", help="the machine it ran on (when the folder has no provenance.json)")
    sub.add_parser("render", help="regenerate every ledger block of the docs and the forest plot")
    sub.add_parser("verify", help="recompute every figure the docs print; exit 1 on any mismatch")
    args = parser.parse_args(argv)
    root = (args.root or default_root()).resolve()
    try:
        if args.command == "import":
            from fedderm.ledger import records

            seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
            report = records.import_folder(
                args.folder, args.sweep_file, root, quick=args.quick, gpu=args.gpu, sets=_sets(args.set),
                seeds=seeds, name=args.name, commit=args.commit, machine=args.machine,
            )  # fmt: skip
            print(report)
            return 0
        from fedderm.ledger import docs

        if args.command == "render":
            errors, changes = docs.render(root)
            for line in changes:
                print(f"changed: {line}")
            for line in errors:
                print(f"error: {line}", file=sys.stderr)
            return 1 if errors else 0
        errors = docs.verify(root)
        for line in errors:
            print(f"error: {line}", file=sys.stderr)
        print(f"ledger: {'OK' if not errors else f'{len(errors)} error(s)'}")
        return 1 if errors else 0
    except LedgerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
