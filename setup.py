"""Builds kvtier's compiled modules, the indexes of `lru` (kvtier/policies/_compact_lru.pyx) and
`prefix-freq` (kvtier/policies/_compact_prefix.pyx), and the `cudaMemcpyAsync` loop of the engine <-> CPU
handlers (kvtier/handlers/_memcpy_loop.pyx; no CUDA headers needed: it calls a function address).

Everything else is in pyproject.toml. The extensions are optional: without a C compiler (or
Cython, outside pip's build isolation) the install succeeds and both policies run their
pure-Python fallbacks (same decisions, more memory and CPU); tests/policies/test_compact_lru.py
and test_compact_prefix.py fail on a machine that has a compiler but did not build them.

`-ffp-contract=off`: prefix-freq's clock, stamps and scores must round exactly as the pure-Python
policy's floats do, so no multiply-add may be fused."""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # pip installs Cython first (pyproject.toml [build-system] requires)
    print("kvtier: Cython is not installed: lru and prefix-freq will use their pure-Python fallbacks")
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension(f"kvtier.policies.{name}", [f"kvtier/policies/{name}.pyx"], optional=True,
                   extra_compile_args=["-ffp-contract=off"])
         for name in ("_compact_lru", "_compact_prefix")]
        + [Extension("kvtier.handlers._memcpy_loop", ["kvtier/handlers/_memcpy_loop.pyx"], optional=True)],
        compiler_directives={"language_level": "3"},
    )

setup(ext_modules=ext_modules)
