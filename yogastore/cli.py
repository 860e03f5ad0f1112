"""Command line: ``yogastore {list,info,verify,delete,du,gc,queue} [--store URL]``.

Also ``python -m yogastore``. Every failure, a usage mistake included, is one
``error:`` line on stderr and exit code 1; ``verify`` exits 1 when any chunk
is damaged, after naming each one. An id or version starting with ``-`` goes
after ``--`` (``yogastore info -- -d 1``). ``delete`` and ``gc`` take
``--coordination single-writer`` for an object store that ignores conditional
writes (the ``coordination`` option of ``Store``); the other commands only read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from storage_backends.errors import (
    CorruptCacheError,
    DatasetNotFoundError,
    InvalidArgumentError,
    KeyNotFoundError,
    YogaStoreError,
)
from storage_backends.s3_options import Coordination
from yogastore.format import ChunkView
from yogastore.queue.cli import add_queue_parser, run_queue
from yogastore.read.reader import verify_chunk
from yogastore.store import DatasetRef, Store

__all__ = ["main"]

_EPILOG = "An id or version that starts with '-' goes after '--': yogastore info -- -d 1"


_OPTIONS = ("--", "-h", "--help", "--store", "--coordination")
#: Commands that change a store under its locks: the ones ``--coordination`` is for.
_LOCKING = ("delete", "gc")
_COORDINATION_HELP = (
    "how writers on an object store are kept apart: 'probe' (default) refuses a store "
    "that ignores conditional writes; 'single-writer' proceeds there, safe only while "
    "no other process builds, deletes or runs gc in the store"
)


class _Usage(Exception):
    """A command line that does not parse."""


class _Parser(argparse.ArgumentParser):
    """Reports a usage mistake as one ``error:`` line and exit code 1, as every failure."""

    def error(self, message: str) -> NoReturn:
        raise _Usage(f"{message} (see `{self.prog} --help`)")


def _open(store: Store, dataset_id: str, version: str) -> DatasetRef:
    """Open a version; say so when it is missing because it is being built now."""
    try:
        return store.open(dataset_id, version)
    except DatasetNotFoundError:
        root = _local_path(store)
        if (root is None or root.is_dir()) and store.building(dataset_id, version):
            raise DatasetNotFoundError(
                f"dataset {dataset_id!r} version {version!r} in {store.url} is not committed "
                "yet: a build is in progress (it holds the build lock); try again when it "
                "finishes"
            ) from None
        raise


def _verify(store: Store, dataset_id: str, version: str) -> int:
    ref = _open(store, dataset_id, version)
    columns = ref.manifest.columns()
    damaged = 0
    for i, info in enumerate(ref.manifest.chunks):
        where = f"{ref.manifest.where} chunk {i} ({info.key})"
        try:
            data = store.backend.get(info.key)
            verify_chunk(ref.manifest, i, data)
            ChunkView(data, columns, info.count, where)
        except KeyNotFoundError:
            damaged += 1
            print(f"damaged: {where}: missing", file=sys.stderr)
        except CorruptCacheError as err:
            # A file of the store that shrank fails every chunk after it: one error, not one
            # line per chunk.
            store.backend.check_mapped(info.key)
            damaged += 1
            text = str(err)
            print(f"damaged: {text if where in text else f'{where}: {text}'}", file=sys.stderr)
    if damaged:
        print(
            f"{dataset_id}/{version}: {damaged} of {len(ref.manifest.chunks)} chunks damaged; "
            f"delete this version (yogastore delete {dataset_id} {version}) and build it again",
            file=sys.stderr,
        )
        return 1
    print(
        f"{dataset_id}/{version}: {len(ref.manifest.chunks)} chunks, {ref.num_records} records OK"
    )
    return 0


def _local_path(store: Store) -> Path | None:
    if store.remote:
        return None
    from storage_backends.lmdb_backend import LmdbBackend

    return store.backend.root if isinstance(store.backend, LmdbBackend) else None


def _info(store: Store, dataset_id: str, version: str) -> int:
    ref = _open(store, dataset_id, version)
    created = ref.manifest.created
    when = created.get("time")
    root = _local_path(store)
    summary = {
        "dataset_id": ref.dataset_id,
        "version": ref.version,
        "location": str(root / dataset_id / version)
        if root
        else f"{store.url}/{dataset_id}/{version}",
        "num_records": ref.num_records,
        "bytes": ref.nbytes,
        "bytes_on_disk": store.backend.disk_usage(f"{dataset_id}/{version}/"),
        "chunks": len(ref.manifest.chunks),
        "build_id": ref.manifest.build_id,
        "built_at": (
            datetime.datetime.fromtimestamp(when, datetime.UTC).isoformat(timespec="seconds")
            if isinstance(when, int | float) and 0 <= when < 1e11
            else None
        ),
        "built_on": created.get("host"),
        "build_in_progress": store.building(dataset_id, version),
        "components": dict(
            zip(ref.schema.paths, [c.to_json() for c in ref.schema.components], strict=True)
        ),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _open_store(args: argparse.Namespace) -> Store:
    coordination = getattr(args, "coordination", None)
    if coordination is None:
        return Store(args.store)
    try:
        return Store(args.store, coordination=coordination)
    except InvalidArgumentError as err:
        Store(args.store)  # raises if the URL itself is the problem
        raise InvalidArgumentError(
            f"--coordination is an option of object stores (s3://), whose locks rest on "
            f"conditional writes; {args.store or 'the default store'} locks without them: "
            f"leave it out ({err})"
        ) from err


def _run(args: argparse.Namespace) -> int:
    store = _open_store(args)
    root = _local_path(store)
    if args.command in ("list", "du", "gc") and root is not None and not root.exists():
        print(f"no store at {root} (nothing cached there yet)")
        return 0
    if args.command == "list":
        for entry in store.list():
            print(
                f"{entry.dataset_id}\t{entry.version}\t{entry.num_records} records\t"
                f"{entry.bytes / 1e6:.1f} MB"
            )
        return 0
    if args.command == "du":
        total = 0
        for dataset_id, version in store.versions():
            used = store.backend.disk_usage(f"{dataset_id}/{version}/")
            total += used
            print(f"{used / 1e6:10.1f} MB\t{dataset_id}/{version}")
        print(f"{store.backend.disk_usage() / 1e6:10.1f} MB\ttotal ({store.url})")
        return 0
    if args.command == "gc":
        removed = store.gc()
        for gone in removed:
            what = "leftover keys" if gone.committed else "uncommitted build"
            print(
                f"removed {what} of {gone.dataset_id}/{gone.version}: "
                f"{gone.keys} keys, {gone.bytes / 1e6:.1f} MB"
            )
        print(f"gc: {len(removed)} versions cleaned")
        return 0
    if args.command == "queue":
        return run_queue(store, args)
    if args.command == "info":
        return _info(store, args.dataset_id, args.version)
    if args.command == "verify":
        return _verify(store, args.dataset_id, args.version)
    store.delete(args.dataset_id, args.version)
    print(f"deleted {args.dataset_id}/{args.version}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = _Parser(
        prog="yogastore",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    store_help = "store URL (default: $YOGASTORE_HOME or ~/.cache/yogastore)"
    parser.add_argument("--store", default=None, help=store_help)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text, with_version in (
        ("list", "list cached dataset versions", False),
        ("info", "print a dataset version's summary", True),
        ("verify", "check every chunk; name each damaged one", True),
        ("delete", "delete a dataset version, its leftovers and lock", True),
        ("du", "size on disk of every version", False),
        ("gc", "remove leftovers of dead builds (never a build in progress)", False),
    ):
        cmd = sub.add_parser(name, help=text, epilog=_EPILOG if with_version else None)
        # Accepted after the command too; the default keeps the one given before.
        cmd.add_argument("--store", default=argparse.SUPPRESS, help=store_help)
        if name in _LOCKING:
            choices = [c.value for c in Coordination]
            cmd.add_argument("--coordination", choices=choices, help=_COORDINATION_HELP)
        if with_version:
            cmd.add_argument("dataset_id")
            cmd.add_argument("version")
    add_queue_parser(sub, store_help)
    try:
        args = parser.parse_args(argv)
        return _run(args)
    except _Usage as err:
        tokens = sys.argv[1:] if argv is None else list(argv)
        dashed = [t for t in tokens if t.startswith("-") and t.split("=")[0] not in _OPTIONS]
        tip = "; an id or version starting with '-' goes after '--'" if dashed else ""
        print(f"error: {err}{tip}", file=sys.stderr)
        return 1
    except (YogaStoreError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
