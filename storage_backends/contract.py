"""The contract every storage backend passes, as a pytest suite to subclass.

A backend written outside this project runs it from its own tests (this module
imports pytest; importing ``storage_backends`` does not import it). Subclass
``BackendContract`` and provide a ``backend`` fixture returning a fresh, empty
backend::

    import pytest
    from storage_backends.contract import BackendContract

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def backend(self, tmp_path):
            backend = MyBackend(f"my://{tmp_path}")
            yield backend
            backend.close()

Two hooks are optional: ``reopen`` (another backend object on the same store;
the default constructs ``type(backend)(backend.url)``) and ``lose_lock`` (make
a held lock lost, as a takeover by another process would; the default skips
the fencing tests, right for a backend whose locks cannot be lost, like a
kernel file lock).
"""

from __future__ import annotations

import threading
import time

import pytest

from storage_backends.base import Backend, check_capabilities
from storage_backends.errors import (
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    LockLostError,
    LockTimeoutError,
    StorageError,
)

__all__ = ["DATA", "BackendContract"]

#: A value the tests store; ten distinct bytes.
DATA = b"0123456789"


class BackendContract:
    """Tests of the rules stated on ``storage_backends.base.Backend``."""

    def reopen(self, backend: Backend) -> Backend:
        """Return another backend object on the store of ``backend`` (closed by the test)."""
        return type(backend)(backend.url)

    def lose_lock(self, backend: Backend, name: str) -> None:
        """Make the held lock ``name`` lost, as when another process took it over."""
        pytest.skip(f"{type(backend).__name__} locks cannot be lost while held")

    def test_capabilities_declared(self, backend: Backend) -> None:
        cls = type(backend)
        assert cls.schemes and all(isinstance(s, str) for s in cls.schemes)
        assert isinstance(backend.remote, bool)
        assert isinstance(backend.coordinated, bool)
        check_capabilities(backend)  # raises naming the attribute
        problem = backend.exclusive_puts_problem()
        assert problem is None or (isinstance(problem, str) and problem), problem

    def test_put_get_roundtrip(self, backend: Backend) -> None:
        backend.put("a/b/value", DATA)
        backend.put("top", memoryview(b"xyz"))
        backend.put("a/empty", b"")
        assert bytes(backend.get("a/b/value")) == DATA
        assert bytes(backend.get("top")) == b"xyz"
        assert bytes(backend.get("a/empty")) == b""

    def test_put_copies_holds_when_the_buffer_changes(self, backend: Backend) -> None:
        """``put_copies``: a put keeps nothing of the buffer it was given.

        As a build gives it: a view of the start of a larger buffer, several MiB long,
        written over once the put returned.
        """
        if not backend.put_copies:
            pytest.skip(f"{type(backend).__name__} does not declare put_copies")
        size = 6 << 20
        value = bytes(range(256)) * (size // 256)
        small = bytearray(DATA)
        for method in ("put", "put_exclusive"):
            buffer = bytearray(value) + bytearray(b"\xee" * 4096)
            getattr(backend, method)(f"a/{method}", memoryview(buffer)[:size])
            getattr(backend, method)(f"a/{method}-small", memoryview(small))
            buffer[:] = b"\x11" * len(buffer)
            small[:] = b"X" * len(small)
            assert backend.size(f"a/{method}") == size
            assert bytes(backend.get(f"a/{method}")) == value
            assert bytes(backend.get_range(f"a/{method}", size - 300, 300)) == value[-300:]
            assert bytes(backend.get(f"a/{method}-small")) == DATA
            small[:] = DATA

    def test_put_replaces(self, backend: Backend) -> None:
        backend.put("k", b"old value")
        backend.put("k", b"new")
        assert bytes(backend.get("k")) == b"new"
        assert backend.size("k") == 3

    def test_missing_key(self, backend: Backend) -> None:
        backend.put("present", b"x")
        with pytest.raises(KeyNotFoundError):
            backend.get("absent")
        with pytest.raises(KeyNotFoundError):
            backend.get_range("absent", 0, 1)
        with pytest.raises(KeyNotFoundError):
            backend.size("absent")
        with pytest.raises(FileNotFoundError):  # the built-in base class works too
            backend.get("dir/absent")

    @pytest.mark.parametrize(
        ("start", "length", "expected"),
        [(0, 10, DATA), (2, 3, b"234"), (7, 3, b"789"), (9, 1, b"9"), (0, 1, b"0")],
        ids=["all", "middle", "to-end", "last-byte", "first-byte"],
    )
    def test_get_range_exact(
        self, backend: Backend, start: int, length: int, expected: bytes
    ) -> None:
        backend.put("r", DATA)
        assert bytes(backend.get_range("r", start, length)) == expected

    @pytest.mark.parametrize(
        ("start", "length"),
        [(8, 3), (9, 2), (10, 1), (11, 1), (0, 11)],
        ids=["overlaps-end", "one-past", "starts-at-end", "starts-past-end", "too-long"],
    )
    def test_get_range_past_end(self, backend: Backend, start: int, length: int) -> None:
        backend.put("r", DATA)
        with pytest.raises(InvalidArgumentError):
            backend.get_range("r", start, length)

    @pytest.mark.parametrize("start", [0, 5, 10], ids=["start", "middle", "at-end"])
    def test_zero_length_range(self, backend: Backend, start: int) -> None:
        backend.put("r", DATA)
        assert bytes(backend.get_range("r", start, 0)) == b""

    def test_negative_range(self, backend: Backend) -> None:
        backend.put("r", DATA)
        with pytest.raises(InvalidArgumentError):
            backend.get_range("r", -1, 2)
        with pytest.raises(InvalidArgumentError):
            backend.get_ranges("r", [(0, 1), (2, -1)])

    def test_get_ranges_in_order(self, backend: Backend) -> None:
        backend.put("r", DATA)
        ranges = [(7, 3), (0, 2), (10, 0), (4, 1), (0, 10)]
        got = [bytes(b) for b in backend.get_ranges("r", ranges)]
        assert got == [b"789", b"01", b"", b"4", DATA]
        assert backend.get_ranges("r", []) == []

    def test_put_exclusive(self, backend: Backend) -> None:
        backend.put_exclusive("x/once", b"first")
        with pytest.raises(KeyExistsError):
            backend.put_exclusive("x/once", b"second")
        with pytest.raises(FileExistsError):
            backend.put_exclusive("x/once", b"first")
        assert bytes(backend.get("x/once")) == b"first"

    def test_list_sorted_and_filtered(self, backend: Backend) -> None:
        keys = ["b/x/y", "a/2", "a/1", "ab/1", "a/sub/3", "c"]
        for key in keys:
            backend.put(key, key.encode())
        assert backend.list("") == sorted(keys)
        assert backend.list("a/") == ["a/1", "a/2", "a/sub/3"]
        assert backend.list("a/sub/") == ["a/sub/3"]
        assert backend.list("b/") == ["b/x/y"]
        assert backend.list("zzz/") == []
        with pytest.raises(InvalidArgumentError):
            backend.list("a")  # a prefix names a directory: it ends with '/'

    def test_delete(self, backend: Backend) -> None:
        backend.put("d/1", b"1")
        backend.put("d/2", b"2")
        backend.delete("d/1")
        backend.delete("d/1")  # deleting a missing key is not an error
        backend.delete("never/there")
        assert backend.list("d/") == ["d/2"]
        assert not backend.exists("d/1")

    def test_delete_prefix(self, backend: Backend) -> None:
        for key in ["p/1", "p/q/2", "pq/3", "other"]:
            backend.put(key, b"v")
        backend.delete_prefix("p/")
        assert backend.list("") == ["other", "pq/3"]
        backend.delete_prefix("p/")  # nothing left: fine
        backend.delete_prefix("missing/")
        with pytest.raises(InvalidArgumentError):
            backend.delete_prefix("")
        backend.put("p/1", b"again")  # the prefix is usable again
        assert bytes(backend.get("p/1")) == b"again"

    def test_exists_and_size(self, backend: Backend) -> None:
        backend.put("e/k", DATA)
        assert backend.exists("e/k")
        assert not backend.exists("e/other")
        assert not backend.exists("nothing/here")
        assert backend.size("e/k") == len(DATA)

    @pytest.mark.parametrize(
        "key", ["", "/a", "a/", "a//b", "a/../b", "./a", "a\\b", "a\x00b"], ids=repr
    )
    def test_invalid_keys(self, backend: Backend, key: str) -> None:
        with pytest.raises(InvalidArgumentError):
            backend.put(key, b"x")
        with pytest.raises(InvalidArgumentError):
            backend.get(key)

    def test_lock_mutual_exclusion(self, backend: Backend) -> None:
        inside = 0
        overlaps = 0
        entries = 0
        guard = threading.Lock()
        errors: list[BaseException] = []

        def worker() -> None:
            nonlocal inside, overlaps, entries
            try:
                for _ in range(3):
                    with backend.lock("locks/shared", timeout=30):
                        with guard:
                            inside += 1
                            overlaps += inside > 1
                            entries += 1
                        time.sleep(0.02)
                        with guard:
                            inside -= 1
            except BaseException as err:  # surfaced below
                errors.append(err)

        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert entries == 9
        assert overlaps == 0

    def test_lock_timeout(self, backend: Backend) -> None:
        holding = threading.Event()
        release = threading.Event()

        def holder() -> None:
            with backend.lock("locks/held"):
                holding.set()
                release.wait(30)

        thread = threading.Thread(target=holder)
        thread.start()
        try:
            assert holding.wait(30)
            started = time.monotonic()
            with pytest.raises(LockTimeoutError), backend.lock("locks/held", timeout=0.3):
                pass
            waited = time.monotonic() - started
            assert 0.25 <= waited < 10
            with pytest.raises(TimeoutError), backend.lock("locks/held", timeout=0):
                pass
        finally:
            release.set()
            thread.join()
        with backend.lock("locks/held", timeout=10):  # free again once released
            pass

    def test_locks_are_independent(self, backend: Backend) -> None:
        with backend.lock("locks/one", timeout=5), backend.lock("locks/two", timeout=5):
            pass

    def test_lock_excludes_another_backend_object(self, backend: Backend) -> None:
        other = self.reopen(backend)
        try:
            with backend.lock("locks/shared", timeout=10):
                with pytest.raises(LockTimeoutError), other.lock("locks/shared", timeout=0.2):
                    pass
                backend.put("locks/shared/k", b"held")
            with other.lock("locks/shared", timeout=10):
                assert bytes(other.get("locks/shared/k")) == b"held"
        finally:
            other.close()

    def test_lock_held_looks_without_taking(self, backend: Backend) -> None:
        other = self.reopen(backend)
        try:
            assert not other.lock_held("locks/looked")
            with backend.lock("locks/looked", timeout=10):
                assert other.lock_held("locks/looked")
                assert not other.lock_held("locks/other")
            assert not other.lock_held("locks/looked")
            with other.lock("locks/looked", timeout=10):  # looking left it free
                pass
        finally:
            other.close()

    def test_lost_lock_fences_writes(self, backend: Backend) -> None:
        with backend.lock("ds/1", timeout=10):
            backend.put("ds/1/c-a-000000", b"chunk")
            self.lose_lock(backend, "ds/1")
            with pytest.raises(LockLostError) as info:
                backend.put_exclusive("ds/1/manifest.json", b"manifest")
            assert isinstance(info.value, StorageError)
            with pytest.raises(LockLostError):
                backend.put("ds/1/c-a-000001", b"chunk")
            with pytest.raises(LockLostError):
                backend.delete_prefix("ds/1/")
            backend.put("elsewhere", b"fine")  # only the locked prefix is fenced
        assert not backend.exists("ds/1/manifest.json")
        assert not backend.exists("ds/1/c-a-000001")
        assert backend.exists("ds/1/c-a-000000")
