"""Command line: ``python -m yogastore {list,info,verify,delete} [--store URL]``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from storage_backends.errors import YogaStoreError
from yogastore.format import ChunkView
from yogastore.reader import verify_once
from yogastore.store import Store

__all__ = ["main"]


def _verify(store: Store, dataset_id: str, version: str) -> int:
    ref = store.open(dataset_id, version)
    columns = ref.manifest.columns()
    for i, info in enumerate(ref.manifest.chunks):
        data = store.backend.get(info.key)
        verify_once(store.url + "#cli", ref.manifest, i, data)
        ChunkView(data, columns, info.count, f"{ref.manifest.where} chunk {i} ({info.key})")
    print(
        f"{dataset_id}/{version}: {len(ref.manifest.chunks)} chunks, {ref.num_records} records OK"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m yogastore", description=__doc__)
    parser.add_argument("--store", default=None, help="store URL (default: $YOGASTORE_HOME)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list cached dataset versions")
    for name, text in (
        ("info", "print a dataset's manifest summary"),
        ("verify", "check every chunk's checksum and structure"),
        ("delete", "delete a dataset version"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("dataset_id")
        cmd.add_argument("version")
    args = parser.parse_args(argv)
    try:
        store = Store(args.store)
        if args.command == "list":
            for entry in store.list():
                print(
                    f"{entry.dataset_id}\t{entry.version}\t{entry.num_records} records\t"
                    f"{entry.bytes / 1e6:.1f} MB"
                )
            return 0
        if args.command == "info":
            ref = store.open(args.dataset_id, args.version)
            summary = {
                "dataset_id": ref.dataset_id,
                "version": ref.version,
                "num_records": ref.num_records,
                "bytes": ref.nbytes,
                "chunks": len(ref.manifest.chunks),
                "build_id": ref.manifest.build_id,
                "components": dict(
                    zip(ref.schema.paths, [c.to_json() for c in ref.schema.components], strict=True)
                ),
            }
            print(json.dumps(summary, indent=2))
            return 0
        if args.command == "verify":
            return _verify(store, args.dataset_id, args.version)
        store.delete(args.dataset_id, args.version)
        print(f"deleted {args.dataset_id}/{args.version}")
        return 0
    except YogaStoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
