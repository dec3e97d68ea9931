"""Builds kvtier's compiled modules: the block table (kvtier/index/_table.pyx and _table_api.pyx, with
their .pxd declarations), the indexes of `lru` (kvtier/policies/_compact_lru.pyx) and `prefix-freq`
(kvtier/policies/_compact_prefix*.pyx), which `cimport` it, the `cudaMemcpyAsync` loop of the engine <->
CPU handlers (kvtier/transfer/handlers/_memcpy_loop.pyx; no CUDA headers needed: it calls a function address)
and their job planner (kvtier/transfer/handlers/_job_plan.pyx; its pure-Python twin is
kvtier/transfer/handlers/job_plan.py's `plan_job_py`, same plans, slower).

Everything else is in pyproject.toml. The extensions are optional: without a C compiler (or
Cython, outside pip's build isolation) the install succeeds and both policies run their
pure-Python fallbacks (same decisions, more memory and CPU); tests/policies/test_compact_lru.py
and test_compact_prefix.py fail on a machine that has a compiler but did not build them.

`-ffp-contract=off`: prefix-freq's clock, stamps and scores must round exactly as the pure-Python
policy's floats do, so no multiply-add may be fused."""

from setuptools import Extension, setup

# The block table first (the policies cimport it), then the policies' eviction orders.
COMPILED_INDEXES = ("index._table", "index._table_api", "policies._compact_lru", "policies._compact_prefix_order",
                    "policies._compact_prefix_ghosts", "policies._compact_prefix")

try:
    from Cython.Build import cythonize
except ImportError:  # pip installs Cython first (pyproject.toml [build-system] requires)
    print("kvtier: Cython is not installed: lru and prefix-freq will use their pure-Python fallbacks")
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension(f"kvtier.{name}", [f"kvtier/{name.replace('.', '/')}.pyx"], optional=True,
                   extra_compile_args=["-ffp-contract=off"])
         for name in COMPILED_INDEXES]
        + [Extension(f"kvtier.transfer.handlers.{name}", [f"kvtier/transfer/handlers/{name}.pyx"], optional=True)
           for name in ("_memcpy_loop", "_job_plan")],
        compiler_directives={"language_level": "3"},
        include_path=["."],  # where `cimport kvtier.index._table` finds kvtier/index/_table.pxd
    )

setup(ext_modules=ext_modules)
