"""The version book's decisions: what is current, what may be unloaded, which leases may go."""

from __future__ import annotations

from pathlib import Path

from bucketrl.generator.adapters import VersionBook


def _book(*versions: int, loaded: bool = True) -> VersionBook:
    book = VersionBook("r")
    for v in versions:
        book.add(v, f"L{v}", Path(f"/x/v{v}"), 0.1)
        if loaded:
            book.mark_loaded(v)
    return book


def test_names_follow_invariant_3() -> None:
    book = _book(3)
    assert book.current().name == "r-v3"  # type: ignore[union-attr]


def test_pending_is_the_newest_unloaded_version_newer_than_current() -> None:
    book = _book(1)
    assert book.pending() is None
    book.add(2, "L2", Path("/x/v2"), 0.1)
    superseded = book.add(3, "L3", Path("/x/v3"), 0.1)
    assert [s.version for s in superseded] == [2]  # fetched, never loaded: its lease must be released
    assert book.pending().version == 3  # type: ignore[union-attr]
    assert book.current().version == 1  # type: ignore[union-attr]
    book.mark_loaded(3)
    assert book.pending() is None and book.current().version == 3  # type: ignore[union-attr]


def test_retire_keeps_in_flight_and_window_versions() -> None:
    book = _book(1, 2, 3, 4)  # newest 4, max_staleness 1 -> window is {3, 4}
    book.begin(1)  # a batch sampled with v1 is still being submitted
    out = book.retire(max_staleness=1, capacity=10)
    assert [s.version for s in out] == [2]  # v1 is in flight, v3 is in the window, v4 current
    book.end(1)
    assert [s.version for s in book.retire(max_staleness=1, capacity=10)] == [1]
    assert book.loaded_versions() == [3, 4]


def test_retire_makes_room_for_a_pending_version_oldest_first() -> None:
    book = _book(5, 6, 7)
    book.add(8, "L8", Path("/x/v8"), 0.1)
    # Window 4 keeps all of 5..7, but the engine holds 3 and needs a slot for v8.
    out = book.retire(max_staleness=4, capacity=3, reserve=1)
    assert [s.version for s in out] == [5]
    assert book.retire(max_staleness=4, capacity=3, reserve=1) == []


def test_a_pinned_version_outlives_the_window_and_goes_last_for_room() -> None:
    """A version whose evaluation is not done stays loaded past the staleness window; when the engine needs a
    slot, idle unpinned versions go first; unpinned, it retires as usual."""
    book = _book(1, 2, 3, 4)  # window {3, 4}
    book.pin(1)
    assert [s.version for s in book.retire(max_staleness=1, capacity=10)] == [2]
    assert book.loaded_versions() == [1, 3, 4]
    book.add(5, "L5", Path("/x/v5"), 0.1)
    assert [s.version for s in book.retire(max_staleness=2, capacity=3, reserve=1)] == [3]  # not the pinned v1
    assert [s.version for s in book.retire(max_staleness=2, capacity=2, reserve=1)] == [1]  # no other left
    assert book.pinned() == set()
    book = _book(1, 2, 3)
    book.pin(1)
    book.unpin(1)
    assert [s.version for s in book.retire(max_staleness=1, capacity=10)] == [1]


def test_idle_leases_are_handed_out_once_and_no_longer_renewed() -> None:
    book = _book(1, 2)
    book.begin(2)
    assert book.take_idle_leases() == ["L1"]
    assert book.take_idle_leases() == []
    assert book.leases() == {2: "L2"}
    assert book.loaded_versions() == [1, 2]  # the weights stay until they leave the window
    assert not book.replace_lease(1, "L1", "L1b")  # released on purpose: do not resurrect it
    assert book.replace_lease(2, "L2", "L2b") and book.leases() == {2: "L2b"}


def test_the_adapter_cache_keeps_only_the_books_versions_and_newer(tmp_path: Path) -> None:
    """Issue 10 item 11: superseded and retired versions leave the disk; a crashed fetch's .tmp goes at start."""
    from bucketrl.generator.adapters import clear_stale_tmp, gc_cache

    for name in ("v1", "v2", "v3", "v4", "v5", ".tmp-v6-dead", "notes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    assert clear_stale_tmp(tmp_path) == 1 and not (tmp_path / ".tmp-v6-dead").exists()
    book = _book(2, 3)
    book.begin(2)  # v2 still sampled from, v3 current
    superseded = book.add(5, "L5", tmp_path / "v5", 0.1)  # v5 fetched (pending); v4 was superseded before
    assert superseded == []
    # v1 retired, v4 superseded: gone. v2, v3 (on the book) and v5 (pending) stay; so does anything newer
    # than the newest known version (it may be being fetched) and what is not a version directory.
    (tmp_path / "v7").mkdir()
    assert gc_cache(tmp_path, book.versions(), book.newest_known) == [1, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "v2", "v3", "v5", "v7"]


def test_a_downloading_versions_lease_is_renewed_and_can_be_replaced() -> None:
    """Plausible-list item: the lease taken before a (slow) download is renewed during it, like the book's."""
    book = _book(1)
    book.begin_fetch(2, "L2")
    assert book.leases() == {1: "L1", 2: "L2"}
    assert book.replace_lease(2, "L2", "L2b")  # it expired during the download: the keeper leased again
    assert book.end_fetch(2) == "L2b" and book.leases() == {1: "L1"}
    assert book.end_fetch(2) == ""
