"""`kvtier.testing` as a third party uses it: imported from outside this repo, suites subclassed."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

THIRD_PARTY_TESTS = textwrap.dedent('''
    from kvtier.testing import BackendTests, PolicyTests
    from kvtier.policies.lru_pure import PureLRUCachePolicy
    from kvtier.tiers.memory import MemoryBackend


    class TestMyPolicy(PolicyTests):
        policy_factory = PureLRUCachePolicy


    class TestMyBackend(BackendTests):
        def make_backend(self, num_blocks, block_bytes):
            return MemoryBackend("mine", num_blocks, block_bytes)
''')


def test_suites_run_from_a_third_party_directory(tmp_path):
    (tmp_path / "test_mine.py").write_text(THIRD_PARTY_TESTS)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    passed = int(run.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert passed >= 20, run.stdout[-500:]


def test_importing_the_package_pulls_in_no_test_framework():
    code = "import sys, kvtier.testing as t; t.__all__; print('pytest' in sys.modules, 'hypothesis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_every_export_resolves():
    import kvtier.testing as t

    for name in t.__all__:
        assert isinstance(getattr(t, name), type), name


BROKEN_POLICIES = textwrap.dedent('''
    from kvtier.policies.lru_pure import PureLRUCachePolicy
    from kvtier.testing import PolicyTests


    class RaisesOnAbsentRemove(PureLRUCachePolicy):
        def remove(self, key):
            if self.get(key) is None:
                raise KeyError(key)
            super().remove(key)


    class RefusesNegativeEvict(PureLRUCachePolicy):
        def evict(self, n, protected):
            return None if n < 0 else super().evict(n, protected)


    class TestAbsentRemove(PolicyTests):
        policy_factory = RaisesOnAbsentRemove


    class TestNegativeEvict(PolicyTests):
        policy_factory = RefusesNegativeEvict
''')


def test_a_broken_policy_is_told_which_clause_it_broke(tmp_path):
    """A third-party policy failing `PolicyTests` sees the contract clause in the failure, not a
    bare AssertionError or a KeyError from its own code."""
    from kvtier.testing.policy_contract import EVICT_NONPOSITIVE, REMOVE_ABSENT

    (tmp_path / "test_broken.py").write_text(BROKEN_POLICIES)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                          "test_insert_get_remove or test_evict_zero_and_negative", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "2 failed, 2 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    parts = re.split(r"_{3,} (\S+) _{3,}", run.stdout)  # [before, name, section, name, section, ...]
    sections = dict(zip(parts[1::2], parts[2::2]))
    absent = sections["TestAbsentRemove.test_insert_get_remove"]
    negative = sections["TestNegativeEvict.test_evict_zero_and_negative"]
    assert f"AssertionError: {REMOVE_ABSENT}: remove() of a key removed before raised KeyError" in absent, absent
    assert f"AssertionError: {EVICT_NONPOSITIVE}: evict(-1) returned None" in negative, negative


BROKEN_BACKEND = textwrap.dedent('''
    from kvtier.testing import BackendTests
    from kvtier.tiers.memory import MemoryBackend


    class ClosesOnce(MemoryBackend):
        def close(self):
            if getattr(self, "closed_once", False):
                raise RuntimeError("already closed")
            self.closed_once = True
            super().close()


    class TestClosesOnce(BackendTests):
        def make_backend(self, num_blocks, block_bytes):
            return ClosesOnce("mine", num_blocks, block_bytes)

        def teardown_method(self, method=None):
            self.__dict__.pop("_open_backends", None)  # (its second close would fail every test)
''')


def test_a_broken_backend_is_told_which_clause_it_broke(tmp_path):
    from kvtier.testing.backend_contract import CLOSE

    (tmp_path / "test_broken_backend.py").write_text(BROKEN_BACKEND)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "close_twice",
                          str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "1 failed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"AssertionError: {CLOSE}: the second close() raised RuntimeError: already closed" in run.stdout, \
        run.stdout[-3000:]
