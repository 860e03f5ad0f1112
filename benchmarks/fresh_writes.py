"""Plain writes of new files to a disk, on blocks never written before and on freed ones.

Run from the repository root::

    python -m benchmarks.fresh_writes                    # 6 files of 1 GiB in benchmarks/results
    python -m benchmarks.fresh_writes --files 4 --mib 512 --dir /some/disk

Writes ``--files`` new files of ``--mib`` MiB each (one random 4 MiB block repeated, ``fsync``
after each), keeping them all (so ``--files`` x ``--mib`` must fit on the disk); deletes
them; then writes as many new files again, which the file system may place on the blocks
just freed. Prints the seconds of every write. On a
thin-provisioned virtual disk (a cloud VM's), a block written for the first time can cost
several times a rewrite of one written before; a cache build writes new files like these,
so a benchmark that compares a build with a plain write has to time both close together
(``benchmarks/_varlen.py``, ``build_rows``). Every file written, and the folder made for
them inside ``--dir`` (which must exist), is deleted at the end.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks._methods import write_floor_file

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=6, help="files per round")
    parser.add_argument("--mib", type=int, default=1024, help="MiB per file")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="an existing directory to write in (default: benchmarks/results)",
    )
    args = parser.parse_args(argv)
    if args.files < 1 or args.mib < 1:
        parser.error("--files and --mib must be at least 1")
    if args.dir is None:
        RESULTS.mkdir(exist_ok=True)
        args.dir = RESULTS
    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not an existing directory")
    work = args.dir / f"fresh-writes-{os.getpid()}"
    work.mkdir()
    block = os.urandom(4 << 20)
    nbytes = args.mib << 20
    paths = [work / f"f{i}.bin" for i in range(args.files)]
    try:
        for label in ("new files, nothing freed before", "new files after deleting those"):
            seconds = []
            for path in paths:
                os.sync()
                seconds.append(write_floor_file(block, nbytes, path))
            print(f"{label}: " + ", ".join(f"{s:.2f}" for s in seconds) + f" s per {args.mib} MiB")
            for path in paths:
                path.unlink()
            os.sync()
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
        work.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
