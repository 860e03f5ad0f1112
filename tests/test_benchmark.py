"""The read benchmark runs end to end on a tiny size and reports numbers from real reads.

No timing is asserted: only that every method read the records it should have,
that their bytes match the source, and that the table and JSON say so.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from benchmarks import _yogadl
from benchmarks._varlen import BUILD_PAIRS, build_pairs
from benchmarks.read_throughput import evaluate_targets, format_case

ROOT = Path(__file__).resolve().parent.parent
TIMED_ROWS = ("a", "b", "c", "d", "d4", "e1", "e2", "e3")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.read_throughput",
        "--records=300",
        "--record-bytes=96",
        "--small-records=400",
        "--large-records=12",
        "--images-records=200",
        "--text-records=300",
        "--jpeg-records=30",
        "--repeats=2",
        "--read-mib=1",
        "--no-yogadl",
        f"--work-dir={tmp / 'work'}",
        f"--json={out}",
    ]
    env = dict(os.environ, YOGASTORE_HOME=str(tmp / "home"), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp / "work").exists(), "scratch dir must be removed without --keep"
    return json.loads(out.read_text()), proc.stdout


FIXED_KEYS = ["a", "b", "c", "d", "d4", "e1", "e2", "e3", "f", "g", "g2", "g3"]
VAR_KEYS = ["a", "a'", "e3", "e3'", "b", "b'", "b1", "b2", "b0", "b0'", "z", "z'"]
VAR_KEYS += ["c", "c2", "c3", "d", "d4", "p"]
FIXED_TARGETS = [
    "(b) tf.data / (a) TFRecordDataset",
    "(c) batches / (d) numpy gather",
    "(b) tf.data / (f) YogaDL",
    "(g) build / plain iteration",
]
VAR_TARGETS = [
    "(b) tf.data / (a) TFRecordDataset",
    "(b) tf.data / (e3) shard+shuffle",
    "(b') / (a'), consumed in the graph",
    "(b') / (e3'), consumed in the graph",
    "(c) batches / (d) memory gather",
    "(c) batches / (p) Grain+ArrayRecord",
    "(g) build / (iteration + write)",
    "(g2) build / (iteration + write)",
]
CONTENDED = "(k2) / (k1), one core busy"


@pytest.mark.slow
def test_every_case_and_method_is_reported(tiny_run: tuple[dict, str]) -> None:
    doc, stdout = tiny_run
    names = [c["case"]["name"] for c in doc["cases"]]
    assert names == ["main", "small", "large", "images", "text", "jpeg"]
    expected = {
        "main": ([*FIXED_KEYS, "k1", "k2"], [*FIXED_TARGETS, CONTENDED]),
        "small": (FIXED_KEYS, FIXED_TARGETS),
        "large": (FIXED_KEYS, FIXED_TARGETS),
        "images": ([*VAR_KEYS, "k1", "k2", "g", "g2", "g3"], [*VAR_TARGETS, CONTENDED]),
        "text": ([*VAR_KEYS, "g", "g2", "g3"], VAR_TARGETS),
        "jpeg": ([*VAR_KEYS, "h1", "h2", "g", "g2", "g3"], VAR_TARGETS),
    }
    for case in doc["cases"]:
        keys, targets = expected[case["case"]["name"]]
        assert [r["key"] for r in case["rows"]] == keys
        assert [t["target"] for t in case["targets"]] == targets
        rate = {r["key"]: r["rate"] for r in case["rows"]}
        got = {b["bound"]: b["value"] for b in case["bounds"]}
        # (d4) is (d) from memory in 4 KiB pages: printed beside the targets, none of its own.
        assert got["(c) / (d4), the ceiling in 4 KiB pages"] == rate["c"] / rate["d4"]
        if case["case"]["kind"] != "fixed":
            # (b2): fresh processes read the first epochs, each epoch's count and sum checked.
            fresh = next(r for r in case["rows"] if r["key"] == "b2")
            assert fresh["error"] is None and fresh["runs_ok"], fresh
            assert len(fresh["epoch_rates"]) == 4 and len(fresh["rates"]) == 2
            # The bounds are ratios of the case's own rows, printed under its targets.
            assert got == {
                "(z) / (a), the Python loop alone": rate["z"] / rate["a"],
                "(z') / (a'), the graph's consumer alone": rate["z'"] / rate["a'"],
                "(b0) / (e3), the hand-over alone": rate["b0"] / rate["e3"],
                "(b0') / (e3'), the hand-over alone": rate["b0'"] / rate["e3'"],
                "(b2) / (e3), a fresh process's first epochs": rate["b2"] / rate["e3"],
                "(c) / (d4), the ceiling in 4 KiB pages": rate["c"] / rate["d4"],
            }
    assert stdout.count("targets:") == 6
    assert stdout.count("bounds (no target):") == 6
    assert "skipped (--no-yogadl)" in stdout
    assert doc["machine"]["nproc"] >= 1


VAR_TIMED = ("a", "a'", "e3", "e3'", "b", "b'", "b1", "b0", "b0'", "z", "z'", "c", "c2", "c3", "d")
VAR_TIMED += ("d4", "p")
VAR_TIMED += ("k1", "k2")


@pytest.mark.slow
@pytest.mark.parametrize("key", VAR_TIMED, ids=VAR_TIMED)
def test_variable_length_rows_read_exact_bytes(tiny_run: tuple[dict, str], key: str) -> None:
    doc, _ = tiny_run
    for case in doc["cases"]:
        spec = case["case"]
        if spec["kind"] == "fixed" or key not in {r["key"] for r in case["rows"]}:
            continue
        row = next(r for r in case["rows"] if r["key"] == key)
        assert row["error"] is None, row["error"]
        check = row["verified"]
        # Every record of the untimed pass, byte for byte (and every token id for text).
        assert check["ok"] and check["wrong_records"] == 0 and check["labels_match"]
        assert check["byte_sum"] == check["expected_byte_sum"] > 0
        n, shards, rank = spec["records"], spec["num_shards"], spec["shard_rank"]
        span = (rank + 1) * n // shards - rank * n // shards
        sharded = len(range(rank, n, shards))
        one_pass = {"a": n, "a'": n, "k1": n, "e3": sharded, "e3'": sharded}.get(key, span)
        assert check["records"] == check["expected_records"] == one_pass
        assert row["runs_ok"] and row["records_per_run"] == row["passes"] * one_pass
        assert row["rate"] > 0


@pytest.mark.slow
def test_decode_rows_decode_real_jpegs(tiny_run: tuple[dict, str]) -> None:
    doc, _ = tiny_run
    jpeg = next(c for c in doc["cases"] if c["case"]["name"] == "jpeg")
    for key in ("h1", "h2"):
        row = next(r for r in jpeg["rows"] if r["key"] == key)
        assert row["error"] is None and row["runs_ok"] and row["verified"]["ok"]
        assert row["verified"]["decoded_shape"][1:] == [64, 64, 3]


@pytest.mark.slow
@pytest.mark.parametrize("key", TIMED_ROWS, ids=TIMED_ROWS)
def test_numbers_come_from_verified_reads(tiny_run: tuple[dict, str], key: str) -> None:
    doc, _ = tiny_run
    for case in doc["cases"]:
        spec = case["case"]
        if spec["kind"] != "fixed":
            continue  # test_variable_length_rows_read_exact_bytes
        n, shards, rank = spec["records"], spec["num_shards"], spec["shard_rank"]
        row = next(r for r in case["rows"] if r["key"] == key)
        assert row["error"] is None, row["error"]
        check = row["verified"]
        # The untimed pass saw each expected record exactly once, with the right bytes.
        assert check["ok"] and check["labels_match"] and check["wrong_records"] == 0
        assert check["records"] == check["expected_records"] > 0
        assert check["byte_sum"] == check["expected_byte_sum"] > 0
        one_pass = (
            n
            if key in ("a", "e1")
            else (
                (rank + 1) * n // shards - rank * n // shards
                if key in ("b", "c", "d", "d4")
                else len(range(rank, n, shards))
            )
        )
        assert check["records"] == one_pass
        # Every timed run read whole passes of exactly those records.
        assert row["runs_ok"]
        assert row["records_per_run"] == row["passes"] * one_pass
        assert len(row["rates"]) == spec["repeats"]
        assert row["rate"] > 0 and row["mb_per_s"] > 0


@pytest.mark.slow
def test_stream_tf_row_has_peak_rss_and_build_rows_counted(tiny_run: tuple[dict, str]) -> None:
    doc, _ = tiny_run
    for case in doc["cases"]:
        if case["case"]["kind"] != "fixed":
            continue
        rows = {r["key"]: r for r in case["rows"]}
        assert rows["b"]["peak_rss_mib"] >= rows["b"]["rss_after_import_mib"] > 0
        assert rows["b"]["read_per_epoch"] > 0
        for key in ("g", "g2"):
            assert rows[key]["verified"]["records"] == case["case"]["records"]
            assert rows[key]["build_seconds"] > 0 and rows[key]["iterate_seconds"] > 0
        floor = rows["g3"]  # the same number of bytes as the cache, written and synced
        assert floor["runs_ok"] and floor["write_seconds"] > 0
        assert floor["bytes_written"] == floor["verified"]["expected_bytes"] > 0
        ratio = next(t for t in case["targets"] if t["target"].startswith("(g)"))
        assert ratio["value"] == pytest.approx(
            rows["g"]["build_seconds"] / rows["g"]["iterate_seconds"]
        )


@pytest.mark.slow
def test_variable_length_builds_are_paired_with_writes_of_their_own(
    tiny_run: tuple[dict, str],
) -> None:
    doc, _ = tiny_run
    for case in doc["cases"]:
        if case["case"]["kind"] == "fixed":
            continue
        rows = {r["key"]: r for r in case["rows"]}
        repeats = case["case"]["repeats"]
        pairs = build_pairs(repeats)
        assert pairs % 2 == 0 and pairs >= max(repeats, BUILD_PAIRS)
        for key in ("g", "g2"):
            row = rows[key]
            assert row["verified"]["records"] == case["case"]["records"]
            assert len(row["build_all"]) == len(row["write_all"]) == pairs
            assert all(w > 0 for w in row["write_all"])
            ratios = [
                b / (row["iterate_seconds"] + w)
                for b, w in zip(row["build_all"], row["write_all"], strict=True)
            ]
            write_first, build_first = ratios[0::2], ratios[1::2]  # the orders alternate
            assert row["ratio_write_first"] == pytest.approx(statistics.median(write_first))
            assert row["ratio_build_first"] == pytest.approx(statistics.median(build_first))
            both = (row["ratio_write_first"] + row["ratio_build_first"]) / 2
            assert row["ratio_with_write"] == pytest.approx(both)
            target = next(t for t in case["targets"] if t["target"].startswith(f"({key}) "))
            assert target["value"] == pytest.approx(row["ratio_with_write"])
        assert rows["g3"]["bytes_written"] == case["dataset_bytes"] > 0
        assert len(rows["g3"]["write_all"]) == repeats


def test_missing_yogadl_is_reported_with_its_reason(tmp_path: Path) -> None:
    not_a_venv = tmp_path / "somewhere"
    not_a_venv.mkdir()
    (not_a_venv / "keep.txt").write_text("user data")
    python, why = _yogadl.ensure_venv(not_a_venv, log=lambda _msg: None)
    assert python is None and "not a virtual environment" in why
    assert (not_a_venv / "keep.txt").exists()
    rows = [
        {"key": "a", "name": "a", "rate": 100.0, "runs_ok": True},
        {"key": "b", "name": "b", "rate": 300.0, "runs_ok": True},
        {"key": "f", "name": "YogaDL", "rate": None, "error": None, "note": f"not measured: {why}"},
    ]
    targets = evaluate_targets(rows)
    yogadl = next(t for t in targets if "YogaDL" in t["target"])
    assert yogadl["value"] is None and not yogadl["met"]
    assert next(t for t in targets if "TFRecord" in t["target"])["met"]
    table = format_case(
        {
            "case": {"name": "t", "records": 1, "batch_size": 1, "shard_rank": 0, "num_shards": 1},
            "record_bytes": 1,
            "chunks": 1,
            "dataset_bytes": 1,
            "tfrecord_bytes": 1,
            "rows": rows,
            "targets": targets,
        }
    )
    assert "not measured: " in table and "NOT MET" in table


def test_profile_build_reports_a_real_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import profile_build

    profile_build.main(["--records", "40", "--shape", "16,3", "--work-dir", str(tmp_path)])
    out = capsys.readouterr().out
    # 40 records of 48 bytes + an 8-byte label, plus chunk headers: a real cache was written.
    size = int(out.split(" bytes) cached")[0].rsplit("(", 1)[1])
    assert 40 * 56 <= size < 100_000
    assert "40 records of (16, 3) uint8" in out
    assert "iterate " in out and "build " in out and "tottime" in out
    assert list(tmp_path.iterdir()) == []  # the store is deleted afterwards


def test_var_groups_times_both_group_sizes_and_restores_the_bridge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import var_groups
    from yogastore.train import tf_read

    size = (tf_read._VAR_GROUP_BYTES, tf_read._VAR_MAX_GROUP, tf_read._VAR_MIN_DEPTH)
    argv = ["--cases", "text", "--text-records", "4000", "--rounds", "2"]
    assert var_groups.main([*argv, "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rounds = [line for line in out.splitlines() if "text round" in line]
    assert len(rounds) == 2
    for line in rounds:  # every row timed in every round, each run's records checked
        rates = [float(p.split(") ")[1].replace(",", "")) for p in line.split(": ")[1].split(", ")]
        assert len(rates) == 3 and min(rates) > 0
    assert "(b32)/(b8) " in out
    memory = out.split("peak anonymous memory while reading: ")[1].splitlines()[0]
    assert [m.split(")")[0] for m in memory.split(", ")] == ["(b8", "(b32", "(z"]
    assert size == (tf_read._VAR_GROUP_BYTES, tf_read._VAR_MAX_GROUP, tf_read._VAR_MIN_DEPTH)
    assert list(tmp_path.iterdir()) == []  # the stores are deleted afterwards
    for bad in ("b8,b8", "b16", ""):
        with pytest.raises(SystemExit, match="--rows"):
            var_groups.main([*argv, "--rows", bad])


def test_fresh_writes_times_both_rounds_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import fresh_writes

    assert fresh_writes.main(["--files", "2", "--mib", "1", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "new files, nothing freed before",
        "new files after deleting those",
    ]
    for line in lines:
        assert len(line.split(":")[1].split(",")) == 2 and line.endswith("s per 1 MiB")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit):
        fresh_writes.main(["--files", "0", "--dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        fresh_writes.main(["--files", "1", "--mib", "1", "--dir", str(tmp_path / "a" / "b")])
    assert list(tmp_path.iterdir()) == []


def test_build_parts_times_puts_strings_and_builds_in_processes_of_their_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import build_parts
    from yogastore.format.encode import _OWN_PIECE_BYTES

    argv = ["--puts", "3", "--value-mb", "0.3", "--dir", str(tmp_path), "--strings-mb", "1"]
    argv += ["--build-records", "600", "--builds", "2", "--sizes", "512,16384", "--repeats", "1"]
    assert build_parts.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:42].strip(): line[42:].split() for line in lines[2:5]}
    # Each row ran in a process of its own; only those that used from_generator saw
    # TensorFlow set the allocator's trim threshold.
    assert {k: v[-1] for k, v in rows.items()} == {
        "no TensorFlow": "no",
        "after from_generator": "yes",
        "after from_generator, thresholds raised": "yes",
    }
    for cells in rows.values():
        assert all(float(c) > 0 for c in cells[:4])
    strings = {line.split()[0]: line.split() for line in lines[8:11]}
    assert list(strings) == ["2-24", "512", "16384"]
    assert lines[11] == "" and lines[12].startswith("build: 2 builds of 600 records")
    # Two builds in each of two processes, each of 600 records (the child checks the count).
    builds = lines[-4:]
    assert [b.split()[0] for b in builds] == ["without"] * 2 + ["after"] * 2
    assert [b.split()[-1] for b in builds] == ["no", "no", "yes", "yes"]
    for b in builds:
        iterate, seconds, in_puts, cpu = (float(c) for c in b.split()[-5:-1])
        assert seconds > 0 and 0 < in_puts < seconds and iterate > 0 and cpu > 0
    assert _OWN_PIECE_BYTES == 2048  # what the build takes as pieces, from that length on
    assert strings["512"][-1] == "joined" and strings["16384"][-1] == "pieces"
    assert list(tmp_path.iterdir()) == []  # every store and file is deleted
    with pytest.raises(SystemExit):
        build_parts.main(["--part", "strings", "--sizes", "0"])


def _pipeline(ds: Any) -> list[str]:
    """The kinds of the datasets ``ds`` is made of, outermost first (with prefetch depths)."""
    out = []
    while ds is not None:
        depth = getattr(ds, "_buffer_size", None)
        out.append(type(ds).__name__ + ("" if depth is None else f"({int(depth)})"))
        ds = getattr(ds, "_input_dataset", None)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "images"])
def test_ceiling_hands_over_as_the_stream_does(tmp_path: Path, kind: str) -> None:
    """(b0) is (b)'s pipeline with the read left out: same stages, spec and records."""
    import yogastore
    from benchmarks import _varlen
    from benchmarks._common import Case, stream_indices

    case = Case(name=kind, records=3000, shape=(), kind=kind, mean_bytes=300, batch_size=64)
    recs = _varlen.make_records(case)
    store = yogastore.Store(str(tmp_path / "store"))
    ref = store.cache(_varlen.DATASET, "1", lambda: _varlen.memory_source(recs))
    ctx = _varlen.VarContext(case, tmp_path, recs, tmp_path / "none", store, ref)
    make, order, k = _varlen.ceiling_dataset(ctx)
    stream = ref.stream(
        shard_rank=case.shard_rank, num_shards=case.num_shards, shuffle=True, seed=case.seed
    )
    ours, theirs = make(1), stream.to_tf_dataset(case.batch_size)
    assert k > 1  # several batches per call, as (b) hands them over
    assert _pipeline(ours) == _pipeline(theirs)
    assert ours.element_spec == theirs.element_spec
    got = [(b["y"].numpy(), b["x"].numpy()) for b in ours]
    want = [(b["y"].numpy(), b["x"].numpy()) for b in theirs]
    assert [len(y) for y, _ in got] == [len(y) for y, _ in want]
    assert np.array_equal(np.concatenate([y for y, _ in got]), order)
    assert np.array_equal(order, stream_indices(ref, case, 1))
    for (y1, x1), (y2, x2) in zip(got, want, strict=True):
        assert np.array_equal(y1, y2) and list(x1) == list(x2)


@pytest.mark.slow
def test_build_pairs_survive_leftovers_of_an_interrupted_run(tmp_path: Path) -> None:
    """A write file or a built dataset left by a killed run neither fails nor fakes a pair."""
    import yogastore
    from benchmarks import _methods, _varlen
    from benchmarks._common import Case

    case = Case(name="text", records=120, shape=(), kind="text", mean_bytes=300, repeats=2)
    recs = _varlen.make_records(case)
    tfrecord = tmp_path / "records.tfrecord"
    _varlen.write_tfrecord(tfrecord, recs)
    store = yogastore.Store(str(tmp_path / "store"))
    ref = store.cache(_varlen.DATASET, "1", lambda: _varlen.tfrecord_source(tfrecord, case))
    ctx = _varlen.VarContext(case, tmp_path, recs, tfrecord, store, ref)
    (tmp_path / "write-g-0.bin").write_bytes(b"left over")
    (tmp_path / "write-g-2.bin").write_bytes(b"left over")
    store.cache("build-g2-1", "1", lambda: _varlen.memory_source(recs))  # a cache hit if kept
    built: list[str] = []

    class CountingStore:  # the real store; counts the sources it is made to read
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def cache(self, name: str, version: str, make: Any) -> Any:
            def counted() -> Any:
                built.append(name)
                return make()

            return store.cache(name, version, counted)

    ctx = dataclasses.replace(ctx, store=CountingStore())
    shim = SimpleNamespace(case=case, ref=ref, data=recs.x, work=tmp_path)
    rows = {r["key"]: r for r in _varlen.build_rows(ctx, lambda: _methods._write_floor(shim))}
    assert sorted(rows) == ["g", "g2", "g3"]
    for key in ("g", "g2"):
        assert rows[key]["runs_ok"] and len(rows[key]["build_all"]) == build_pairs(case.repeats)
        assert rows[key]["error"] is None
    # Every pair built its dataset (a leftover taken as built would be a cache hit).
    assert built == [
        f"build-{k}-{i}" for k in ("g", "g2") for i in range(build_pairs(case.repeats))
    ]
    assert [v.dataset_id for v in store.list()] == [_varlen.DATASET]
    assert not list(tmp_path.glob("write-*"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cases", "text", "--text-records", "3"], "--text-records 3: rank 0 of 4 would read"),
        (["--cases", "main", "--records", "-5"], "--records -5: rank 0 of 4"),
        (["--cases", "images", "--shard-rank", "4"], "--shard-rank 4: must be below"),
        (["--cases", "jpeg", "--num-shards", "0"], "--num-shards 0: must be at least 1"),
        (["--cases", "small", "--batch-size", "0"], "--batch-size 0: must be at least 1"),
        (["--cases", "main", "--max-seconds-per-run", "nan"], "--max-seconds-per-run nan"),
        (["--cases", "mian"], "unknown case 'mian'"),
    ],
)
def test_read_throughput_refuses_sizes_it_cannot_measure(argv: list[str], message: str) -> None:
    """Refused before any work, naming the option (a rank with no records measured nothing)."""
    from benchmarks import read_throughput

    with pytest.raises(SystemExit) as err:
        read_throughput.build_cases(read_throughput.parse_args(argv))
    assert message in str(err.value)


def test_read_throughput_takes_the_smallest_measurable_sizes() -> None:
    from benchmarks import read_throughput

    args = read_throughput.parse_args(["--cases", "text,main", "--text-records", "4"])
    cases = read_throughput.build_cases(args)
    assert [(c.name, c.records, c.rank_span()) for c in cases] == [
        ("text", 4, 1),
        ("main", 262144, 65536),
    ]


def test_base_page_copies_are_equal_and_not_huge(tmp_path: Path) -> None:
    from benchmarks._common import huge_mapped_kib, in_base_pages

    a = np.arange(3_000_000, dtype=np.int64).reshape(1000, 3000)  # 24 MB: numpy asks for THP
    b = in_base_pages(a)
    assert b.shape == a.shape and b.dtype == a.dtype and np.array_equal(a, b)
    assert not np.shares_memory(a, b)
    assert in_base_pages(np.empty(0, np.uint8)).size == 0
    # The copy's mapping carries MADV_NOHUGEPAGE ("nh") and holds no huge page.
    start = b.__array_interface__["data"][0]
    flags, huge, mine = "", -1, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(v, 16) for v in head[0].split("-"))
            mine = lo <= start < hi
        elif mine and head[0] == "AnonHugePages:":
            huge = int(head[1])
        elif mine and head[0] == "VmFlags:":
            flags = line
    assert " nh" in flags and huge == 0
    # A mapped file is counted under its path: resident KiB, and at most that in 2 MiB pages.
    path = tmp_path / "mapped.bin"
    path.write_bytes(bytes(range(256)) * 4096)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i] for i in range(0, len(m), 4096)) == 0  # every page touched
        rss, pmd = huge_mapped_kib(str(path))
        assert rss >= 1024 and 0 <= pmd <= rss
    assert huge_mapped_kib(str(tmp_path / "never-mapped")) == (0, 0)
