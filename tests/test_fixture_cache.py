"""The fixture cache (difftest_fixtures/cache.py): built once, published whole, keyed by contents."""

from __future__ import annotations

import os

import pytest

from difftest_fixtures import cache


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_fixture_derived_from_a_source_rewritten_with_the_same_size_and_mtime_is_built_afresh(empty_cache, tmp_path):
    from difftest.base.content_digest import signature

    source = tmp_path / "target"
    source.mkdir()
    weights = source / "model.safetensors"
    weights.write_bytes(b"\x01" * 64)
    stamp = weights.stat().st_mtime_ns
    before = cache.publish_keyed("group", "derived", [signature(source)], lambda tmp: None)
    weights.write_bytes(b"\x02" * 64)
    os.utime(weights, ns=(stamp, stamp))
    assert cache.publish_keyed("group", "derived", [signature(source)], lambda tmp: None) != before


def test_a_keyed_fixture_is_written_once_per_key(empty_cache):
    calls = []

    def write(tmp):
        calls.append(tmp)
        (tmp / "data.txt").write_text("x")

    first = cache.publish_keyed("group", "thing", ["recipe", 1], write)
    again = cache.publish_keyed("group", "thing", ["recipe", 1], write)
    other = cache.publish_keyed("group", "thing", ["recipe", 2], write)
    assert (first == again, first != other, len(calls)) == (True, True, 2)
    assert (first / "data.txt").read_text() == "x"


def test_a_failed_keyed_build_leaves_nothing_behind(empty_cache):
    def write(tmp):
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        cache.publish_keyed("group", "thing", ["recipe"], write)
    assert sorted(p.name for p in (empty_cache / "fixtures" / "group").iterdir()) == [".locks"]


def test_a_named_build_of_an_unknown_fixture_names_the_known_ones(empty_cache):
    with pytest.raises(KeyError, match="unknown fixture 'tiny-nope'; known: a, b"):
        cache.ensure_built(["tiny-nope"], ["a", "b"], {}, {"a": [], "b": []})


def test_named_builds_run_dependencies_first_and_once(empty_cache):
    order = []

    def builder(name):
        def write(out, build):
            order.append(name)
            (out / "name").write_text(name)

        return write

    deps = {"target": [], "draft": ["target"]}
    paths = cache.ensure_built(["draft"], ["target", "draft"], {n: builder(n) for n in deps}, deps, log=lambda m: None)
    cache.ensure_built(["draft"], ["target", "draft"], {n: builder(n) for n in deps}, deps, log=lambda m: None)
    assert order == ["target", "draft"]
    assert (paths["draft"] / "name").read_text() == "draft"


def test_a_killed_builders_leftovers_are_cleared_by_the_next_build_of_that_fixture_only(tmp_path):
    (tmp_path / ".tmp-tiny.abc123").mkdir()  # a killed build of "tiny"
    (tmp_path / ".tmp-tiny-draft.def456").mkdir()  # another fixture's build, maybe still running
    cache.build_once(tmp_path / "tiny", lambda tmp: (tmp / "x").write_text("x"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", ".tmp-tiny-draft.def456", "tiny"]


def test_two_fixtures_build_side_by_side_but_one_fixture_once(tmp_path):
    import threading

    started = threading.Barrier(2, timeout=10)
    calls = []

    def write(tmp):
        calls.append(tmp.name)
        started.wait()  # both builders are inside their builds at once: different fixtures do not wait on each other
        (tmp / "x").write_text("x")

    threads = [threading.Thread(target=cache.build_once, args=(tmp_path / n, write)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache.build_once(tmp_path / "a", write)
    assert len(calls) == 2 and sorted(p.name for p in tmp_path.iterdir()) == [".locks", "a", "b"]
