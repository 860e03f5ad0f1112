"""The TensorFlow kernel of the read bridge: strings cut from bytes + ranges in tf.data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import yogastore
from yogastore.train import tf_ops

N = 300


def _record(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(1000 + i)
    size = 0 if i % 5 == 0 else int(rng.integers(1, 200)) + (5000 if i % 37 == 3 else 0)
    return {
        "s": rng.bytes(size),
        "pair": [rng.bytes(int(rng.integers(0, 3))), rng.bytes(int(rng.integers(0, 40)))],
        "words": [rng.bytes(int(rng.integers(0, 6))) for _ in range(i % 3)],
        "label": i,
    }


RECORDS = [_record(i) for i in range(N)]


def _source() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(
        {
            "s": tf.constant([r["s"] for r in RECORDS], tf.string),
            "pair": tf.constant([r["pair"] for r in RECORDS], tf.string),
            "words": tf.ragged.constant([r["words"] for r in RECORDS], tf.string),
            "label": tf.constant([r["label"] for r in RECORDS], tf.int64),
        }
    )


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> yogastore.DatasetRef:
    # 1 KiB chunks: batches span many chunks and some records are larger than a chunk.
    store = yogastore.Store(tmp_path_factory.mktemp("ops"), chunk_bytes=1024)
    ref = store.cache("ops", "1", _source)
    assert ref.num_records == N and len(ref.manifest.chunks) > 20
    return ref


def test_the_kernel_is_built() -> None:
    # make demo / make test build it; without it strings cross as object arrays.
    assert tf_ops.load() is not None, "run: python -m yogastore.train.tf_ops"
    assert tf_ops.build() == tf_ops.library_path()  # built already: nothing to do


@pytest.mark.parametrize("seed", range(4))
def test_gather_bytes_cuts_exact_strings(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 256, int(rng.integers(0, 100_000)), dtype=np.uint8)
    n = int(rng.integers(0, 600))
    starts = rng.integers(0, len(values) + 1, n)
    lengths = rng.integers(0, len(values) + 1 - starts) * (rng.random(n) < 0.8)  # some empty
    got = tf_ops.gather_bytes(values, starts, lengths).numpy().tolist()
    assert got == [values[s : s + k].tobytes() for s, k in zip(starts, lengths, strict=True)]


def test_gather_bytes_of_no_strings() -> None:
    out = tf_ops.gather_bytes(np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert out.shape == (0,) and out.dtype == tf.string


@pytest.mark.parametrize(
    ("values", "starts", "lengths", "message"),
    [
        (np.zeros(10, np.uint8), [0, 4], [4, 7], r"range 1 \(start 4, length 7\) lies outside"),
        (np.zeros(10, np.uint8), [-1], [2], r"range 0 \(start -1, length 2\)"),
        (np.zeros(10, np.uint8), [3], [-1], r"range 0 \(start 3, length -1\)"),
        (np.zeros(10, np.uint8), [11], [0], r"start 11, length 0\) lies outside the 10 bytes"),
        (np.zeros(10, np.uint8), [2**62], [2**62], r"start 4611686018427387904"),
        (np.zeros(10, np.uint8), [0, 1], [1], "one length|Dimensions must be equal"),
        (np.zeros((2, 5), np.uint8), [0], [1], "rank 1|must be a vector"),
    ],
)
def test_gather_bytes_refuses_ranges_outside(
    values: np.ndarray, starts: list[int], lengths: list[int], message: str
) -> None:
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=message):
        tf_ops.gather_bytes(values, np.array(starts, np.int64), np.array(lengths, np.int64))


def _elements(ds: tf.data.Dataset) -> list[dict[str, Any]]:
    out = []
    for batch in ds:
        out.append(
            {
                "s": batch["s"].numpy().tolist(),
                "pair": batch["pair"].numpy().tolist(),
                "words": batch["words"].to_list(),
                "label": batch["label"].numpy().tolist(),
            }
        )
    return out


@pytest.mark.parametrize(("batch_size", "drop"), [(32, False), (7, True), (256, False)])
def test_to_tf_dataset_agrees_with_and_without_the_kernel(
    ref: yogastore.DatasetRef, monkeypatch: pytest.MonkeyPatch, batch_size: int, drop: bool
) -> None:
    def read() -> tuple[Any, list[dict[str, Any]]]:
        stream = ref.stream(shuffle=True, seed=11, num_shards=2, shard_rank=1)
        ds = stream.to_tf_dataset(batch_size=batch_size, drop_remainder=drop)
        return ds.element_spec, _elements(ds)

    spec, with_kernel = read()
    monkeypatch.setenv("YOGASTORE_TF_OPS", "0")
    assert tf_ops.load() is None
    spec_off, without = read()
    assert spec == spec_off == _source().batch(batch_size, drop_remainder=drop).element_spec
    assert with_kernel == without
    labels = [i for b in with_kernel for i in b["label"]]
    expected = N // 2 // batch_size * batch_size if drop else N // 2
    assert len(labels) == expected and len(set(labels)) == expected
    for b in with_kernel:
        assert b["s"] == [RECORDS[i]["s"] for i in b["label"]]
        assert b["pair"] == [RECORDS[i]["pair"] for i in b["label"]]
        assert b["words"] == [RECORDS[i]["words"] for i in b["label"]]


def test_build_writes_the_library_once(tmp_path: Path) -> None:
    path = tf_ops.library_path()
    assert path.name.startswith(f"_tfops-{tf.__version__}-") and path.suffix == ".so"
    before = path.stat().st_mtime_ns
    assert tf_ops.build() == path and path.stat().st_mtime_ns == before
    leftovers = [p for p in path.parent.iterdir() if p.name.startswith(".tfops-")]
    assert leftovers == []


def test_local_strings_cross_as_a_view_of_the_chunks(ref: yogastore.DatasetRef) -> None:
    stream = ref.stream(shuffle=True, seed=2)
    assert stream.strings_in_place()
    for batch in stream.batches(64, strings=yogastore.StringFormat.RANGES):
        s = batch["s"]
        assert isinstance(s, yogastore.StringRanges) and not s.data.flags.writeable
        assert s.data.__array_interface__["data"][0] % 64 == 0  # wrapped by TF, not copied
        assert s.to_numpy().tolist() == [RECORDS[i]["s"] for i in batch["label"]]


def test_the_dataset_outlives_its_stream_and_store(tmp_path: Path) -> None:
    # The strings' bytes are read by the kernel after the generator yields: the
    # arrays handed over keep the mapped chunks alive, whatever the caller drops.
    import gc

    store = yogastore.Store(tmp_path, chunk_bytes=1024)
    ds = store.cache("ops", "1", _source).stream(shuffle=True, seed=4).to_tf_dataset(40)
    del store
    gc.collect()
    got = _elements(ds)
    gc.collect()
    assert got == _elements(ds)
    assert sorted(i for b in got for i in b["label"]) == list(range(N))
    for b in got:
        assert b["s"] == [RECORDS[i]["s"] for i in b["label"]]


class _Steps(yogastore.Stream):
    """A stream whose batches are its own (here: the same records, through an override)."""

    def column_batches(self, batch_size: int, drop_remainder: bool = False) -> Any:
        yield from super().column_batches(batch_size, drop_remainder)


def test_a_stream_subclass_gets_copied_strings(ref: yogastore.DatasetRef) -> None:
    base = ref.stream(shuffle=True, seed=6)
    stream = ref.stream(shuffle=True, seed=6)
    stream.__class__ = _Steps  # as tests/test_batch_groups.py does
    assert not stream.strings_in_place() and base.strings_in_place()
    assert _elements(stream.to_tf_dataset(32)) == _elements(base.to_tf_dataset(32))


def test_without_the_kernel_strings_still_cross_and_it_says_so_once(
    ref: yogastore.DatasetRef,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    expected = _elements(ref.stream(shuffle=True, seed=8).to_tf_dataset(16))  # with the kernel
    monkeypatch.setattr(tf_ops, "library_path", lambda: tmp_path / "_tfops-missing.so")
    monkeypatch.setattr(tf_ops, "_warned", [])
    with caplog.at_level("WARNING", logger="yogastore.train.tf_ops"):
        first = _elements(ref.stream(shuffle=True, seed=8).to_tf_dataset(16))
        second = _elements(ref.stream(shuffle=True, seed=8).to_tf_dataset(16))
    assert first == second == expected
    said = [r.getMessage() for r in caplog.records if "kernel is not built" in r.getMessage()]
    assert len(said) == 1 and "python -m yogastore.train.tf_ops" in said[0]


def test_gather_bytes_fails_on_a_file_that_shrank(tmp_path: Path) -> None:
    path = tmp_path / "mapped.bin"
    path.write_bytes(b"x" * 100)
    st = path.stat()
    values, starts, lengths = np.zeros(8, np.uint8), np.array([0], np.int64), np.array([4])
    ok = tf_ops.gather_bytes(values, starts, lengths, str(path), [st.st_dev, st.st_ino, 100])
    assert ok.numpy().tolist() == [b"\0" * 4]
    with pytest.raises(tf.errors.DataLossError, match="shrank from 200 to 100 bytes"):
        tf_ops.gather_bytes(values, starts, lengths, str(path), [st.st_dev, st.st_ino, 200])
    # Another file at the path (the mapped one was replaced): its pages stay readable.
    other = [st.st_dev, st.st_ino + 1, 200]
    assert tf_ops.gather_bytes(values, starts, lengths, str(path), other).shape == (1,)
    assert tf_ops.gather_bytes(values, starts, lengths, str(tmp_path / "gone"), other).shape == (1,)


# A data file truncated by another process while strings are handed to tf.data in place:
# an error from the reader or the kernel, never SIGBUS (the process must live to report).
TRUNCATED = """
import json, os, sys, time
import numpy as np, tensorflow as tf, yogastore
from yogastore.train import tf_ops
root = sys.argv[1]
ref = yogastore.Store(root).open("ops", "1")
data = os.path.join(root, "ops", "1", "data.mdb")
out = {}
stream = ref.stream(shuffle=True, seed=1)
next(stream.batches(64, strings=yogastore.StringFormat.RANGES))
_path, dev, ino, size = stream.source.mapped_file()
# 120,000 records: far more than tf.data reads ahead (whole groups of batches) before the cut
it = iter(ref.stream(shuffle=True, seed=1, num_epochs=400).to_tf_dataset(16))
next(it)
ranges = ref.stream(shuffle=True, seed=2).batches(4, strings=yogastore.StringFormat.RANGES)
next(ranges), next(ranges)  # batches gathered 1, then 2 at a time: the next is gathered
time.sleep(1)  # the pipeline fills its buffers and waits
os.truncate(data, 4096)
try:
    next(ranges)
    out["ranges"] = "no error"
except yogastore.CorruptCacheError as err:
    out["ranges"] = str(err)
try:
    # (Bytes of no file: converting s.data eagerly would copy, reading the truncated pages.)
    tf_ops.gather_bytes(np.zeros(8, np.uint8), [0], [4], data, [dev, ino, size])
    out["kernel"] = "no error"
except tf.errors.DataLossError as err:
    out["kernel"] = err.message
try:
    for _ in it:
        pass
    out["dataset"] = "no error"
except (tf.errors.OpError, yogastore.YogaStoreError) as err:
    out["dataset"] = str(err)
# The kernel's own race: the file is cut short after its last check (none here: no file
# name), while it copies. tf.data wraps the aligned mapped array without a copy.
import mmap
cut = os.path.join(root, "cut.bin")
with open(cut, "wb") as f:
    f.write(b"a" * (1 << 20))
mapped = np.frombuffer(mmap.mmap(os.open(cut, os.O_RDONLY), 1 << 20, prot=mmap.PROT_READ), np.uint8)
def generate():
    os.truncate(cut, 4096)
    yield mapped
cut_ds = tf.data.Dataset.from_generator(generate, output_signature=tf.TensorSpec([None], tf.uint8))
cut_ds = cut_ds.map(lambda v: tf_ops.gather_bytes(v, [0, 8192, 500000], [100, 100, 100]))
try:
    out["race"] = [len(s) for s in next(iter(cut_ds)).numpy()]
except tf.errors.DataLossError as err:
    out["race"] = err.message
print(json.dumps(out))
"""


@pytest.mark.multiprocess
def test_truncated_under_tf_data_is_an_error_not_sigbus(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    store = yogastore.Store(tmp_path, chunk_bytes=1024)
    store.cache("ops", "1", _source)
    proc = subprocess.run(
        [sys.executable, "-c", TRUNCATED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.splitlines()[-1])
    assert "shrank from" in out["kernel"] and "data.mdb" in out["kernel"]
    assert "shrank" in out["dataset"], out["dataset"]
    assert "shrank" in out["ranges"], out["ranges"]
    assert "SIGBUS: the file under the map was cut short" in out["race"], out["race"]


def test_a_position_dataset_of_strings_goes_through_its_own_batches(tmp_path: Path) -> None:
    # StreamPosition reads through a Stream subclass (EpochRest): strings must not bypass it.
    import yogastore.distributed as yd

    def make() -> tf.data.Dataset:
        x = tf.range(18, dtype=tf.int64)
        return tf.data.Dataset.from_tensor_slices({"x": x, "s": tf.strings.as_string(x)})

    ref = yogastore.Store(tmp_path).cache("pos", "1", make)
    pos = yd.StreamPosition(ref, seed=0)
    seen = []
    for batch in pos.dataset(0, 2, batch_size=4):
        seen += batch["x"].numpy().tolist()
        assert batch["s"].numpy().tolist() == [str(i).encode() for i in batch["x"].numpy()]
        pos.advance()
    assert len(seen) == 8 and len(set(seen)) == 8 and pos.epoch == 1  # 2 whole steps of 4


@pytest.mark.parametrize("shape", [(), (0,), (7,), (4, 3), (2, 0, 5)])
def test_join_bytes_joins_strings_row_major_with_their_lengths(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(shape))
    count = int(np.prod(shape, dtype=np.int64))
    strings = [rng.bytes(int(k)) if k % 3 else b"" for k in rng.integers(0, 9000, count)]
    tensor = tf.constant(np.array(strings, dtype=object).reshape(shape), tf.string)
    values, lengths = tf_ops.join_bytes(tensor)
    assert values.dtype == tf.uint8 and lengths.dtype == tf.int64
    assert values.numpy().tobytes() == b"".join(strings)
    assert lengths.numpy().tolist() == [len(s) for s in strings]


def _long_strings() -> tf.data.Dataset:
    """Strings of 2-9 KB (kept as ``bytes`` without the kernel), a grid of them, empty ones."""
    rng = np.random.default_rng(7)
    sizes = rng.integers(2048, 9000, 700)
    texts = [rng.bytes(int(k)) if i % 9 else b"" for i, k in enumerate(sizes)]
    grid = np.array([[[t, t[:5], b""], [t[-3:], t, t[:2048]]] for t in texts], dtype=object)
    return tf.data.Dataset.from_tensor_slices({"t": np.array(texts, dtype=object), "g": grid})


@pytest.mark.parametrize(("source", "chunk_bytes"), [(_source, 4096), (_long_strings, 256 << 10)])
def test_a_build_with_and_without_the_kernel_stores_the_same_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: Any, chunk_bytes: int
) -> None:
    """The first pass joins dense strings in tf.data with the kernel; the chunks are the same.

    Without it, short strings are joined by other ops and long ones come one ``bytes`` each.
    """
    sums = []
    for kernel in ("1", "0"):
        monkeypatch.setenv("YOGASTORE_TF_OPS", kernel)
        store = yogastore.Store(tmp_path / kernel, chunk_bytes=chunk_bytes)
        ref = store.cache("ops", "1", source, progress=yogastore.NullProgress())
        sums.append([(c.first, c.count, c.checksum) for c in ref.manifest.chunks])
        got = list(ref.stream(shuffle=False))
        want = list(source().as_numpy_iterator())
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            for name, value in w.items():
                assert np.asarray(g[name], object).tolist() == np.asarray(value, object).tolist()
    assert len(sums[0]) > 5 and sums[0] == sums[1]
