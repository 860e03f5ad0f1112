"""Store.cache safety: stale caches, fingerprints, rebuild, infinite sources, guards, casts."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import yogastore
from storage_backends.errors import BuildLimitError, StaleCacheError
from yogastore.build.progress import LineProgress

SPEC = {"x": yogastore.ComponentSpec(shape=(3,), dtype="float32")}


def items(n: int, value: float = 0.0) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(3, value + i, np.float32)} for i in range(n)]


def keys(tmp_path: Path) -> list[str]:
    return yogastore.Store(tmp_path).backend.list("")


def test_fingerprint_is_stored_and_compared(tmp_path: Path) -> None:
    store = yogastore.Store(tmp_path)
    fp = {"files": ["a.tfrecord", "b.tfrecord"], "sizes": [10, 20], "prep": 2}
    ref = store.cache("d", "1", lambda: items(5), spec=SPEC, fingerprint=fp)
    assert (
        ref.manifest.source_fingerprint
        == '{"files":["a.tfrecord","b.tfrecord"],"prep":2,"sizes":[10,20]}'
    )
    # Key order does not matter; the same fingerprint is a hit.
    same = dict(reversed(list(fp.items())))
    assert store.cache("d", "1", lambda: items(9), spec=SPEC, fingerprint=same).num_records == 5
    # Reopened from disk, the field survives the JSON round trip.
    assert store.open("d", "1").manifest.source_fingerprint == ref.manifest.source_fingerprint
    with pytest.raises(StaleCacheError, match=r"prep.*2.*rebuild=True"):
        store.cache("d", "1", lambda: items(9), spec=SPEC, fingerprint={**fp, "prep": 3})
    with pytest.raises(ValueError):  # StaleCacheError is a ValueError too
        store.cache("d", "1", lambda: items(9), spec=SPEC, fingerprint="other")
    rebuilt = store.cache(
        "d", "1", lambda: items(9, 100.0), spec=SPEC, fingerprint="v2", rebuild=True
    )
    assert rebuilt.num_records == 9
    assert rebuilt.manifest.source_fingerprint == "v2"
    assert [float(e["x"][0]) for e in rebuilt.stream(shuffle=False)][:2] == [100.0, 101.0]
    # The old build's chunks are gone: only the new build's keys remain.
    build = rebuilt.manifest.build_id
    assert all(build in k or k.endswith("manifest.json") for k in keys(tmp_path) if k)
    with pytest.raises(yogastore.InvalidArgumentError, match="fingerprint"):
        store.cache("d", "1", lambda: items(1), spec=SPEC, fingerprint={"t": object()})


def test_spec_mismatch_raises_for_iterables_and_tf(tmp_path: Path) -> None:
    import tensorflow as tf

    store = yogastore.Store(tmp_path)
    store.cache("d", "1", lambda: items(4), spec=SPEC)
    other = {"x": yogastore.ComponentSpec(shape=(4,), dtype="float32")}
    with pytest.raises(StaleCacheError, match=r"x: cached .*\(3,\).* vs source .*\(4,\)"):
        store.cache("d", "1", lambda: items(4), spec=other)

    def make(n: int, dtype: tf.DType) -> tf.data.Dataset:
        return tf.data.Dataset.range(n).map(lambda i: tf.cast(i, dtype))

    store.cache("t", "1", lambda: make(6, tf.int64))
    assert store.cache("t", "1", lambda: make(6, tf.int64)).num_records == 6
    with pytest.raises(StaleCacheError, match=r"int64.*float32|float32.*int64"):
        store.cache("t", "1", lambda: make(6, tf.float32))
    ref = store.cache("t", "1", lambda: make(3, tf.float32), rebuild=True)
    assert ref.num_records == 3 and ref.schema.components[0].dtype == "float32"


def test_infinite_source_refused_at_once(tmp_path: Path) -> None:
    import tensorflow as tf

    store = yogastore.Store(tmp_path)
    with pytest.raises(BuildLimitError, match=r"infinite.*repeat"):
        store.cache("inf", "1", lambda: tf.data.Dataset.range(10).repeat())
    assert keys(tmp_path) == []
    with pytest.raises(BuildLimitError, match="max_records=5"):
        store.cache("big", "1", lambda: tf.data.Dataset.range(10), max_records=5)


def test_guards_stop_a_build_and_leave_nothing(tmp_path: Path) -> None:
    def endless() -> object:
        i = 0
        while True:
            yield {"x": np.full(3, i, np.float32)}
            i += 1

    store = yogastore.Store(tmp_path, chunk_bytes=256)
    with pytest.raises(BuildLimitError, match="max_records=100"):
        store.cache("e", "1", endless, spec=SPEC, max_records=100)
    assert keys(tmp_path) == [], "a failed build deletes its chunks"
    with pytest.raises(BuildLimitError, match="max_bytes=1000"):
        store.cache("e", "1", endless, spec=SPEC, max_bytes=1000)
    assert keys(tmp_path) == []
    # Within the guards the build succeeds.
    ref = store.cache("e", "1", lambda: items(50), spec=SPEC, max_records=50, max_bytes=600)
    assert ref.num_records == 50
    with pytest.raises(yogastore.InvalidArgumentError, match="max_records"):
        store.cache("e", "2", lambda: items(1), spec=SPEC, max_records=0)


def test_source_error_deletes_partial_chunks(tmp_path: Path) -> None:
    def broken() -> object:
        for i in range(200):
            yield {"x": np.full(3, i, np.float32)}
        raise OSError("disk gone")

    store = yogastore.Store(tmp_path, chunk_bytes=256)
    with pytest.raises(OSError, match="disk gone"):
        store.cache("b", "1", broken, spec=SPEC)
    assert keys(tmp_path) == []
    assert store.list() == []


@pytest.mark.parametrize(
    ("dtype", "value", "ok"),
    [
        ("int64", np.float32(1.5), False),
        ("int64", np.zeros(2, np.float64), False),
        ("int64", 2.0, False),
        ("int32", np.int64(2**40), False),
        ("bool", np.int64(1), False),
        ("int32", np.int64(7), True),
        ("float32", np.float64(0.5), True),
        ("float32", np.int32(3), True),
        ("int64", 3, True),
    ],
    ids=[
        "f32->i64",
        "f64arr->i64",
        "pyfloat->i64",
        "i64big->i32",
        "i64->bool",
        "i64->i32",
        "f64->f32",
        "i32->f32",
        "pyint->i64",
    ],
)
def test_lossy_cast_refused(tmp_path: Path, dtype: str, value: object, ok: bool) -> None:
    shape = np.shape(value)
    spec = {"v": yogastore.ComponentSpec(shape=shape, dtype=dtype)}
    store = yogastore.Store(tmp_path)
    make = lambda: [{"v": value}]  # noqa: E731
    if ok:
        ref = store.cache("c", "1", make, spec=spec)
        got = next(iter(ref.stream(shuffle=False)))["v"]
        assert np.array_equal(np.asarray(got), np.asarray(value).astype(dtype))
    else:
        with pytest.raises(yogastore.UnsupportedElementError, match=f"'v'.*{dtype}"):
            store.cache("c", "1", make, spec=spec)
        assert keys(tmp_path) == []


def test_line_progress_lines() -> None:
    now = [0.0]
    out = io.StringIO()
    p = LineProgress("caching d/1", 1000, interval=10.0, stream=out, clock=lambda: now[0])
    p.update(100)
    assert out.getvalue() == "", "no line before the interval"
    now[0] = 10.0
    p.add_bytes(2_500_000)
    p.update(150)
    line = out.getvalue().strip()
    assert line == "caching d/1: 250/1000 records, 25.0%, 2.5 MB, 25 records/s, ETA 0:30"
    now[0] = 40.0
    p.update(750)
    p.close()
    p.close()
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 3
    assert lines[-1] == "caching d/1: 1000/1000 records, 100.0%, 2.5 MB, 25 records/s, done in 0:40"
    unknown = LineProgress("x", None, interval=0.0, stream=out, clock=lambda: now[0])
    unknown.update(3)
    assert out.getvalue().strip().splitlines()[-1].startswith("x: 3 records, 0 B")


def test_progress_total_and_log_lines_when_not_a_tty(tmp_path: Path, capfd) -> None:  # type: ignore[no-untyped-def]
    import tensorflow as tf

    store = yogastore.Store(tmp_path)
    store.cache("p", "1", lambda: tf.data.Dataset.range(300))
    err = capfd.readouterr().err
    assert "caching p/1: 300/300 records, 100.0%" in err
    assert "done in" in err


def test_structure_change_names_the_component(tmp_path: Path) -> None:
    import collections

    point = collections.namedtuple("point", "a b")
    other = collections.namedtuple("other", "a b")
    inner = collections.namedtuple("inner", "k")
    c = yogastore.ComponentSpec(shape=(), dtype="int64")
    store = yogastore.Store(tmp_path)
    store.cache("n", "1", lambda: [point(np.int64(1), {"k": np.int64(2)})], spec=point(c, {"k": c}))
    cases = [
        ({"a": c, "b": {"k": c}}, r"<element>: cached namedtuple point\(a, b\) vs source a dict"),
        (
            other(c, {"k": c}),
            r"<element>: cached namedtuple point\(a, b\) vs source namedtuple other",
        ),
        (point(c, inner(c)), r"b: cached a dict with keys \['k'\] vs source namedtuple inner\(k\)"),
        (point(c, {"j": c}), r"b/j: cached no such component vs source tensor int64"),
    ]
    for spec, message in cases:
        with pytest.raises(StaleCacheError, match=message):
            store.cache("n", "1", lambda: [], spec=spec)
