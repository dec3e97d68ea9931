"""Builds kvtier's one compiled module, the `lru` index (kvtier/policies/_compact_lru.pyx).

Everything else is in pyproject.toml. The extension is optional: without a C compiler (or Cython,
outside pip's build isolation) the install succeeds and `lru` runs its pure-Python
fallback (same decisions, more memory); tests/policies/test_compact_lru.py fails on a machine
that has a compiler but did not build it."""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # pip installs Cython first (pyproject.toml [build-system] requires)
    print("kvtier: Cython is not installed: lru will use its pure-Python fallback")
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension("kvtier.policies._compact_lru", ["kvtier/policies/_compact_lru.pyx"], optional=True)],
        compiler_directives={"language_level": "3"},
    )

setup(ext_modules=ext_modules)
