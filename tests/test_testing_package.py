"""`kvtier.testing` as a third party uses it: imported from outside this repo, suites subclassed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

THIRD_PARTY_TESTS = textwrap.dedent('''
    from kvtier.testing import BackendTests, PolicyTests
    from kvtier.policies.lru import LRUCachePolicy
    from kvtier.tiers.memory import MemoryBackend


    class TestMyPolicy(PolicyTests):
        policy_factory = LRUCachePolicy


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
