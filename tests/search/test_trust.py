"""Trust in checked plans (mdsl.search.trust): a plan cache entry this user's mdsl wrote or re-checked is not
re-checked by a later process of this user (same state directory); an entry read under another state
directory is; a changed entry is caught whatever records lie beside it; a record is honoured only with the
key's HMAC of its own digest, kind and mdsl version; a key other users could read or write is not used; a
state directory that cannot be written only warns. `mdsl cache check` re-checks a whole cache at once."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import mdsl
from mdsl.cli import main
from mdsl.search import cache as cache_module
from mdsl.search import plan as plan_module
from mdsl.search import trust
from mdsl.search import variants as V
from mdsl.search.cache import PlanCache
from mdsl.search.engine import cached_plan, optimize
from mdsl.search.plan import Plan, content_digest
from tests.search.small_plans import CONFIG
from tests.search.test_cache_integrity import GRAPH, LOOKUP, _chosen_nodes, _searcher, _with_digest

SEARCHER = _searcher()


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> str:
    """The text of a real entry (a guided search's fused plan with its alternatives)."""
    cache = PlanCache(tmp_path_factory.mktemp("plans"))
    optimize(GRAPH, CONFIG, cache=cache, **LOOKUP)
    return cache.path(cache.key(GRAPH, CONFIG, searcher=SEARCHER)).read_text()


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch, tmp_path):
    """As in a new process: nothing trusted in memory, no warning given yet; the state directory the test's own."""
    monkeypatch.setattr(trust, "_IN_PROCESS", set())
    monkeypatch.setattr(trust, "_WARNED", set())
    monkeypatch.setenv("MDSL_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def rechecks(monkeypatch) -> list:
    """The plans `mdsl.search.cache` re-checks (the re-check itself still runs)."""
    calls = []
    real = cache_module.recheck

    def spy(plan):
        calls.append(plan)
        return real(plan)

    monkeypatch.setattr(cache_module, "recheck", spy)
    return calls


def _digest(text: str) -> str:
    return json.loads(text)["digest"]


def _entry(cache: PlanCache, text: str) -> Path:
    path = cache.path(json.loads(text)["key"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _load(cache: PlanCache):
    return cached_plan(GRAPH, CONFIG, cache=cache, **LOOKUP)


def _tampered(text: str, key: str = None) -> str:
    """The entry with its chosen mugraph's div made a mul and the digest recomputed (under `key`)."""
    data = json.loads(text)
    _chosen_nodes(data)[1]["op"] = "mul"
    if key is not None:
        data["key"] = key
    return _with_digest(data)


# ---------------------------------------------------------------------------------------------
# across processes

READER = textwrap.dedent("""\
    import json, sys
    from mdsl.search import cache
    calls = []
    real = cache.recheck
    cache.recheck = lambda plan: calls.append(1) or real(plan)
    plan = cache.PlanCache(sys.argv[1]).load_key(sys.argv[2], json.loads(sys.argv[3]))
    print(json.dumps({"served": plan is not None, "rechecks": len(calls)}))
    """)


def _read_in_a_new_process(cache: PlanCache, key: str, state: Path) -> dict:
    package_root = str(Path(mdsl.__file__).resolve().parents[1])
    env = dict(os.environ, MDSL_STATE_DIR=str(state),
               PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", READER, str(cache.root), key, json.dumps(SEARCHER)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return json.loads(done.stdout)


@pytest.mark.timeout(240)
def test_a_plan_written_by_one_process_is_not_rechecked_by_the_next_but_under_another_state_dir(stored, tmp_path):
    state = tmp_path / "state"
    cache = PlanCache(tmp_path / "cache")
    key = json.loads(stored)["key"]
    cache.store(key, Plan.from_json(json.loads(stored)["plan"]))   # as a search stores what it verified
    assert cache.path(key).read_text() == stored
    assert _read_in_a_new_process(cache, key, state) == {"served": True, "rechecks": 0}
    # the cache copied elsewhere, read by a user (or state directory) that checked nothing: re-checked once
    elsewhere = PlanCache(tmp_path / "copied")
    shutil.copytree(cache.root, elsewhere.root)
    assert _read_in_a_new_process(elsewhere, key, tmp_path / "other-state") == {"served": True, "rechecks": 1}
    assert _read_in_a_new_process(elsewhere, key, tmp_path / "other-state") == {"served": True, "rechecks": 0}


def test_a_recheck_in_one_process_spares_the_next(stored, tmp_path, rechecks, monkeypatch):
    cache = PlanCache(tmp_path / "cache")
    _entry(cache, stored)
    assert _load(cache) is not None and len(rechecks) == 1
    assert _load(cache) is not None and len(rechecks) == 1     # this process
    monkeypatch.setattr(trust, "_IN_PROCESS", set())           # the next one: the record
    assert _load(cache) is not None and len(rechecks) == 1
    monkeypatch.setenv("MDSL_STATE_DIR", str(tmp_path / "another"))
    monkeypatch.setattr(trust, "_IN_PROCESS", set())
    assert _load(cache) is not None and len(rechecks) == 2


# ---------------------------------------------------------------------------------------------
# what a record cannot vouch for

def _refused(cache: PlanCache, path: Path, match: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _load(cache) is None
    (warning,) = [str(w.message) for w in caught]
    assert f"ignoring the plan cache entry {path}" in warning and match in warning, warning
    assert not os.path.lexists(path)


def test_a_tampered_entry_is_caught_though_the_original_is_trusted(stored, tmp_path, rechecks):
    cache = PlanCache(tmp_path / "cache")
    trust.trust("plan", _digest(stored))
    path = _entry(cache, _tampered(stored))
    _refused(cache, path, "the chosen mugraph fails a re-check")
    assert len(rechecks) == 1


@pytest.mark.parametrize("forgery", ["the record of another digest", "a wrong HMAC", "another key's HMAC",
                                     "another mdsl version's HMAC"])
def test_a_forged_record_is_not_honoured(stored, tmp_path, rechecks, monkeypatch, forgery):
    cache = PlanCache(tmp_path / "cache")
    good = _digest(stored)
    text = _tampered(stored)
    bad = _digest(text)
    trust.trust("plan", good)
    record = trust.record_path("plan", bad)
    if forgery == "the record of another digest":
        shutil.copyfile(trust.record_path("plan", good), record)
    elif forgery == "a wrong HMAC":
        record.write_text("0" * 64)
    elif forgery == "another key's HMAC":
        monkeypatch.setenv("MDSL_STATE_DIR", str(tmp_path / "attacker"))
        trust.trust("plan", bad)
        monkeypatch.setenv("MDSL_STATE_DIR", str(tmp_path / "state"))
        shutil.copyfile(tmp_path / "attacker" / "trusted" / record.name, record)
    else:
        with monkeypatch.context() as m:
            m.setattr(plan_module, "mdsl_version", lambda: "0.0.1")
            trust.trust("plan", bad)
    monkeypatch.setattr(trust, "_IN_PROCESS", set())
    assert not trust.trusted("plan", bad) and trust.trusted("plan", good)
    path = _entry(cache, text)
    _refused(cache, path, "the chosen mugraph fails a re-check")
    assert len(rechecks) == 1


def test_a_record_vouches_for_its_kind_only(tmp_path):
    digest = "ab" * 32
    trust.trust("variants", digest)
    shutil.copyfile(trust.record_path("variants", digest), trust.record_path("plan", digest))
    trust._IN_PROCESS.clear()
    assert trust.trusted("variants", digest) and not trust.trusted("plan", digest)


# ---------------------------------------------------------------------------------------------
# the key and the state directory

def test_the_key_is_made_once_readable_by_this_user_alone(tmp_path):
    trust.trust("plan", "ab" * 32)
    key = tmp_path / "state" / "key"
    info = key.stat()
    assert info.st_size == trust.KEY_BYTES and info.st_mode & 0o777 == 0o600
    before = key.read_bytes()
    trust.trust("plan", "cd" * 32)
    assert key.read_bytes() == before and sorted(os.listdir(tmp_path / "state")) == ["key", "trusted"]


UNSAFE = {
    "group-writable": (lambda key: key.chmod(0o620), "mode 620"),
    "world-readable": (lambda key: key.chmod(0o604), "mode 604"),
    "too short": (lambda key: key.write_bytes(b"x" * 16), "16 bytes"),
    "a link": (lambda key: (key.rename(key.with_name("real")), key.symlink_to("real")), "symbolic link"),
    "a folder": (lambda key: (key.unlink(), key.mkdir()), "not a regular file"),
}


@pytest.mark.parametrize("unsafe", sorted(UNSAFE))
def test_an_unsafe_key_is_not_used(tmp_path, unsafe):
    good, other = "ab" * 32, "cd" * 32
    trust.trust("plan", good)
    change, why = UNSAFE[unsafe]
    change(tmp_path / "state" / "key")
    trust._IN_PROCESS.clear()
    with pytest.warns(UserWarning, match=f"not using the key .*{why}"):
        assert not trust.trusted("plan", good)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # said once
        trust.trust("plan", other)
    assert trust.trusted("plan", other)   # in this process
    assert not trust.record_path("plan", other).exists()
    trust._IN_PROCESS.clear()
    assert not trust.trusted("plan", other)


def test_a_state_dir_that_cannot_be_written_only_warns(stored, tmp_path, rechecks, monkeypatch):
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("MDSL_STATE_DIR", str(tmp_path / "a file" / "state"))
    cache = PlanCache(tmp_path / "cache")
    _entry(cache, stored)
    with pytest.warns(UserWarning, match="could not record a checked plan .* set MDSL_STATE_DIR"):
        assert _load(cache) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _load(cache) is not None   # trusted in this process, and said once
    assert len(rechecks) == 1


def test_records_beyond_the_cap_go_oldest_first(tmp_path, monkeypatch):
    monkeypatch.setattr(trust, "MAX_RECORDS", 3)
    digests = [f"{i:064x}" for i in range(5)]
    for i, digest in enumerate(digests):
        trust.trust("plan", digest)
        os.utime(trust.record_path("plan", digest), ns=(i * 10**9, i * 10**9))
    assert len(os.listdir(tmp_path / "state" / "trusted")) == 3
    trust._IN_PROCESS.clear()
    assert [trust.trusted("plan", d) for d in digests] == [False, False, True, True, True]


def test_the_state_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("MDSL_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert trust.state_dir() == tmp_path / "xdg" / "mdsl"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert trust.state_dir() == tmp_path / "home" / ".local" / "state" / "mdsl"


# ---------------------------------------------------------------------------------------------
# variants entries

def _with_variants(cache: PlanCache, stored: str) -> Plan:
    """The stored plan read back, with its chosen mugraph stored as its one tuning variant."""
    _entry(cache, stored)
    plan = _load(cache)
    assert V.store(cache, plan, [V.TuningVariant(plan.chosen, "the chosen mugraph", 1e-6)], 4) is not None
    return plan


def test_a_variants_entry_written_or_rechecked_is_not_rechecked_again(stored, tmp_path, monkeypatch):
    cache = PlanCache(tmp_path / "cache")
    plan = _with_variants(cache, stored)
    calls = []
    real = V.recheck_candidates
    monkeypatch.setattr(V, "recheck_candidates", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(trust, "_IN_PROCESS", set())
    assert len(V.load(cache, plan)[0]) == 1 and calls == []
    monkeypatch.setenv("MDSL_STATE_DIR", str(tmp_path / "another"))
    monkeypatch.setattr(trust, "_IN_PROCESS", set())
    assert len(V.load(cache, plan)[0]) == 1 and len(calls) == 1
    assert len(V.load(cache, plan)[0]) == 1 and len(calls) == 1


# ---------------------------------------------------------------------------------------------
# mdsl cache check

def _run(capsys, *argv) -> tuple:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.timeout(120)
def test_cache_check_trusts_the_good_entries_and_deletes_the_tampered_one(stored, tmp_path, capsys):
    cache = PlanCache(tmp_path / "cache")
    plan = _with_variants(cache, stored)
    variants_digest = _digest(V.entry_path(cache, json.loads(stored)["key"]).read_text())
    bad = _entry(cache, _tampered(stored, key="f" * 64))
    trust._IN_PROCESS.clear()
    shutil.rmtree(tmp_path / "state")   # nothing checked before
    status, out, err = _run(capsys, "cache", "check", "--dir", str(cache.root), "--jobs", "1")
    assert status == 1, out
    lines = out.splitlines()
    assert sorted(line.split()[:2] for line in lines[:-1]) == [["failed", "plan"], ["passed", "plan"],
                                                                ["passed", "variants"]]
    (failed,) = [line for line in lines if line.startswith("failed")]
    assert str(bad) in failed and "the chosen mugraph fails a re-check" in failed and failed.endswith("(deleted)")
    assert lines[-1].startswith(f"mdsl cache check {cache.root}: 3 entries (2 plans, 1 variants entry): "
                                f"2 passed, 1 failed, 0 skipped, ")
    assert not bad.exists() and cache.path(json.loads(stored)["key"]).exists()
    trust._IN_PROCESS.clear()
    assert trust.trusted("plan", _digest(stored)) and trust.trusted("variants", variants_digest)
    assert plan is not None
    # nothing left to fail
    status, out, err = _run(capsys, "cache", "check", "--dir", str(cache.root), "--jobs", "1")
    assert status == 0 and " 2 passed, 0 failed, 0 skipped, " in out.splitlines()[-1]


@pytest.mark.timeout(120)
def test_cache_check_in_worker_processes_records_in_this_users_state_dir(stored, tmp_path, capsys):
    cache = PlanCache(tmp_path / "cache")
    _entry(cache, stored)
    other = json.loads(stored)
    other["key"] = "e" * 64
    other["plan"]["chosen"]["evidence"]["reason"] += " "   # other content, as verified
    _entry(cache, _with_digest(other))
    trust._IN_PROCESS.clear()
    shutil.rmtree(tmp_path / "state", ignore_errors=True)
    status, out, err = _run(capsys, "cache", "check", "--dir", str(cache.root), "--jobs", "2")
    assert status == 0, out + err
    assert " 2 passed, 0 failed, 0 skipped, " in out.splitlines()[-1]
    assert trust.trusted("plan", _digest(stored)) and trust.trusted("plan", content_digest(other["plan"]))


def test_cache_check_leaves_another_versions_entry_and_a_missing_folder_is_a_usage_error(stored, tmp_path,
                                                                                         capsys):
    cache = PlanCache(tmp_path / "cache")
    data = json.loads(stored)
    data["plan"]["mdsl_version"] = "0.0.1"
    path = _entry(cache, _with_digest(data))
    status, out, err = _run(capsys, "cache", "check", "--dir", str(cache.root), "--jobs", "1")
    assert status == 0 and out.startswith("skipped  plan") and "verified by mdsl 0.0.1" in out and path.exists()
    status, out, err = _run(capsys, "cache", "check", "--dir", str(tmp_path / "nowhere"))
    assert status == 2 and f"no plan cache at {tmp_path / 'nowhere'}" in err
