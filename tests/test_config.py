"""Config validation: every mistake is reported at load time with the field path and a fix."""

import os
import sys
import time

import pytest

from kvtier import ConfigError, build_hierarchy, load_config, load_config_text, parse_config, parse_size
from kvtier.cli.main import main
from kvtier.config import Capacity, HierarchyConfig, TierConfig, default_config_path
from kvtier.config.input import MAX_CONFIG_BYTES
from kvtier.tiers.base import Backend

GOOD_TIER = "{name: cpu, backend: memory, capacity: 8 blocks}"


def tiers(*items: str, head: str = "block_bytes: 1MiB\n") -> str:
    return head + "tiers:\n" + "".join(f"  - {item}\n" for item in items)


BROKEN = [
    # (yaml text, field path, fragment of the message)
    ("tiers: [", "", "invalid YAML at line"),
    ("- just\n- a list\n", "", "must be a mapping"),
    ("block_tokens: 256\n", "tiers", "missing"),
    ("tiers: []\n", "tiers", "non-empty list"),
    ("tiers:\n", "tiers", "non-empty list"),  # (before: 0 tiers, exit 0; the build failed later)
    ("tiers: 3\n", "tiers", "non-empty list"),
    ("tiers:\n  - 5\n", "tiers[0]", "expected a mapping"),
    (tiers("{backend: memory, capacity: 8 blocks}"), "tiers[0].name", "missing"),
    (tiers("{name: cpu, capacity: 8 blocks}"), "tiers[0].backend", "missing"),
    (tiers("{name: cpu, backend: memory}"), "tiers[0].capacity", "missing"),
    (tiers("{name: cpu, backend: memroy, capacity: 8 blocks}"), "tiers[0].backend", "did you mean 'memory'"),
    (tiers("{name: cpu, backend: nosuch.module:Thing, capacity: 8 blocks}"), "tiers[0].backend", "unknown backend"),
    (tiers("{name: cpu, backend: memory, capacity: 64GB}"), "tiers[0].capacity", "did you mean '64GiB'"),
    (tiers("{name: cpu, backend: memory, capacity: 64}"), "tiers[0].capacity", "ambiguous"),
    (tiers("{name: cpu, backend: memory, capacity: lots}"), "tiers[0].capacity", "is not a size"),
    (tiers("{name: cpu, backend: memory, capacity: 0 blocks}"), "tiers[0].capacity", "at least 1 block"),
    (tiers("{name: cpu, backend: memory, capacity: 0GiB}"), "tiers[0].capacity", "must be > 0"),
    # (before: "write '0 blocks' or a size such as '0MiB'", both refused; "unknown unit 'blocks'")
    (tiers("{name: cpu, backend: memory, capacity: 0}"), "tiers[0].capacity", "write e.g. '1000 blocks' or '4GiB'"),
    (tiers("{name: cpu, backend: memory, capacity: 0.5 blocks}"), "tiers[0].capacity", "a whole number"),
    (tiers("{name: cpu, backend: memory, capacity: 64Zb}"), "tiers[0].capacity", "unknown unit"),
    (tiers("{name: cpu, backend: memory, capacity: 512KiB}"), "tiers[0].capacity", "smaller than one block"),
    (tiers("{name: cpu, backend: memory, capacity: [1]}"), "tiers[0].capacity", "expected a size"),
    (tiers("{name: cpu, backend: memory, capacity: 8 blocks, policy: lfu2}"), "tiers[0].policy", "unknown policy"),
    (tiers("{name: cpu, backend: memory, capacity: 8 blocks, policy: lr}"), "tiers[0].policy", "did you mean 'lru'"),
    (tiers("{name: cpu, backend: memory, capacity: 8 blocks, cascade: sometimes}"), "tiers[0].cascade",
     "not one of on_evict, on_store, none"),
    (tiers("{name: cpu, backend: memory, capacity: 8 blocks, reserve: 0.9}"), "tiers[0].reserve", "between 0 and 0.5"),
    (tiers("{name: cpu, backend: memory, capacity: 8 blocks, capacty: 3}"), "tiers[0].capacty",
     "did you mean 'capacity'"),
    (tiers("{name: CPU, backend: memory, capacity: 8 blocks}"), "tiers[0].name", "not a valid tier name"),
    (tiers(GOOD_TIER, GOOD_TIER), "tiers[1].name", "duplicate tier name 'cpu'"),
    ("block_tokens: -4\n" + tiers(GOOD_TIER, head=""), "block_tokens", "positive integer"),
    ("block_tokens: many\n" + tiers(GOOD_TIER, head=""), "block_tokens", "positive integer"),
    ("block_bytes: 2MB\n" + tiers(GOOD_TIER, head=""), "block_bytes", "did you mean '2MiB'"),
    ("store_threshold: -1\n" + tiers(GOOD_TIER, head=""), "store_threshold", "0 (off) or a number of offers"),
    ("blocks_tokens: 4\n" + tiers(GOOD_TIER, head=""), "blocks_tokens", "did you mean 'block_tokens'"),
    (tiers(GOOD_TIER, "{name: far, backend: tests.test_config:NoHandlerBackend, capacity: 8 blocks}"),
     "tiers[0].cascade", "no handler moves blocks"),
]


class _OddSpec:  # a spec type no handler knows
    pass


class NoHandlerBackend(Backend):  # referenced from YAML above as tests.test_config:NoHandlerBackend
    from kvtier.core.specs import BlockIDsLoadStoreSpec as _Base

    spec_type = type("OddLoadStoreSpec", (_Base,), {"medium": staticmethod(lambda: "ODD")})
    OPTIONS: dict = {}


@pytest.mark.parametrize("text, path, fragment", BROKEN,
                         ids=[f"{i:02d}-{b[1] or 'root'}" for i, b in enumerate(BROKEN)])
def test_broken_config_names_the_field(text, path, fragment):
    with pytest.raises(ConfigError) as info:
        load_config_text(text, "test.yaml")
    problems = info.value.problems
    assert any(p == path and fragment in m for p, m in problems), problems


def test_all_problems_are_reported_at_once():
    text = tiers("{name: cpu, backend: memory, capacity: 64GB, policy: nope, extra: 1}")
    with pytest.raises(ConfigError) as info:
        load_config_text(text)
    paths = sorted(p for p, _ in info.value.problems)
    assert paths == ["tiers[0].capacity", "tiers[0].extra", "tiers[0].policy"]


def test_config_error_is_a_value_error_with_readable_text():
    with pytest.raises(ValueError, match=r"tiers\[0\]\.capacity: .*64GiB"):
        load_config_text(tiers("{name: cpu, backend: memory, capacity: 64GB}"))


def test_valid_config_is_frozen_with_defaults_on_fields():
    cfg = load_config_text(tiers(GOOD_TIER))
    tier = cfg.tiers[0]
    assert (tier.policy, tier.cascade, tier.reserve, cfg.block_tokens) == ("prefix-freq", "on_evict", 0.1, 256)
    with pytest.raises(AttributeError):
        tier.policy = "arc"
    with pytest.raises(TypeError):
        tier.options["x"] = 1


def test_policy_defaults_per_tier_and_a_named_policy_wins():
    cfg = load_config_text("""
tiers:
  - {name: hot, backend: memory, capacity: 8 blocks}
  - {name: warm, backend: memory, capacity: 16 blocks}
  - {name: cold, backend: memory, capacity: 32 blocks, policy: arc}
  - {name: last, backend: memory, capacity: 64 blocks, policy: null}
""")
    assert [t.policy for t in cfg.tiers] == ["prefix-freq", "lru", "arc", "lru"]
    hierarchy = build_hierarchy(cfg, dry_run=True)
    try:
        lru = "LRUCachePolicy"  # the compiled indexes (tests/policies/test_compact_*.py: built here)
        assert [type(t.policy).__name__ for t in hierarchy.manager.tiers] == [
            "PrefixFreqCachePolicy", lru, "ARCCachePolicy", lru]
    finally:
        hierarchy.close()


def test_block_counts_take_k_and_m_like_the_cli():
    assert [Capacity.parse(t).blocks for t in ("10000 blocks", "10k blocks", "2M blocks", "1 block")] == \
        [10000, 10000, 2_000_000, 1]
    with pytest.raises(ValueError):
        Capacity.parse("10x blocks")


def test_tiers_built_in_code_get_the_same_default_policies():
    cfg = HierarchyConfig((TierConfig("a", "memory", Capacity(blocks=4)), TierConfig("b", "memory", Capacity(blocks=8)),
                           TierConfig("c", "memory", Capacity(blocks=8), policy="arc")))
    assert [t.policy for t in cfg.tiers] == ["prefix-freq", "lru", "arc"]


def test_sizes_use_binary_units():
    assert parse_size("64GiB") == 64 << 30 and parse_size("1.5MiB") == 3 << 19 and parse_size("4096B") == 4096


def test_shipped_configs_load():
    assert load_config(default_config_path()).tiers[1].options["root_dir"]
    for path in default_config_path().parent.glob("*.yaml"):
        load_config(path)


@pytest.mark.parametrize("backend, capacity, extra", [
    ("memory", "64TiB", ""),
    ("cpu", "64TiB", ""),
    ("file", "1000TiB", ", root_dir: ROOT"),
])
def test_capacity_above_free_memory_or_disk_is_a_config_error(tmp_path, backend, capacity, extra):
    from kvtier import build_hierarchy

    text = tiers(f"{{name: big, backend: {backend}, capacity: {capacity}{extra.replace('ROOT', str(tmp_path))}}}")
    with pytest.raises(ConfigError) as info:
        build_hierarchy(load_config_text(text))
    [(path, message)] = info.value.problems
    assert path == "tiers[0].capacity" and ("more than the" in message or "does not fit" in message)
    assert not any(tmp_path.iterdir())  # nothing allocated


# ---------------------------------------------------------------------------------------------
# Hostile corpus: `kvtier config check` on every bad input gives exit 2, names the field (or the
# file, for problems of the file as a whole), prints no traceback and stays small, and the whole
# corpus runs in well under 5 s. Cases: every BROKEN one above, then the hostile ones of issue 14.
# ---------------------------------------------------------------------------------------------
HOT = "  - {name: hot, backend: memory, capacity: 8 blocks}\n"
FILE = "<the file>"  # expected path: a problem of the file as a whole, named by the file's path


def laughs(use: str, levels: int = 9) -> str:
    """A "billion laughs" alias bomb: anchors a..i, each nine uses of the previous; then `use`."""
    names = "abcdefghijklmnop"[:levels]
    lines = [f"{names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip(names, names[1:])]
    return "\n".join(lines) + "\n" + use + "\n"


def merge_bomb() -> str:
    lines = ["m0: &m0 {k: 1}"] + [f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}]}}" for i in range(1, 40)]
    return "\n".join(lines) + "\ntiers:\n" + HOT


def make_fifo(tmp_path):
    path = tmp_path / "fifo.yaml"
    os.mkfifo(path)
    return str(path)


def make_dir(tmp_path):
    (tmp_path / "adir").mkdir()
    return str(tmp_path / "adir")


def module_tier(field: str, name: str) -> str:
    tier = {"backend": f"{{name: hot, backend: '{name}', capacity: 8 blocks}}",
            "policy": f"{{name: hot, backend: memory, capacity: 8 blocks, policy: '{name}'}}"}[field]
    return f"tiers:\n  - {tier}\n"


# (id, content: str | bytes | callable(tmp_path) -> path, extra argv, exit code, field path, message fragment)
HOSTILE = [
    # the file as a whole: encoding, size, kind
    ("latin-1", b"tiers:\n  - {name: caf\xe9, backend: memory, capacity: 8 blocks}\n", [], 2, FILE, "not UTF-8"),
    ("utf-16", ("tiers:\n" + HOT).encode("utf-16"), [], 2, FILE, "UTF-16"),
    ("utf-16-no-bom", ("tiers:\n" + HOT).encode("utf-16-le"), [], 2, FILE, "NUL bytes"),
    ("utf-32", ("tiers:\n" + HOT).encode("utf-32"), [], 2, FILE, "UTF-32"),
    ("binary", bytes(range(256)) * 8, [], 2, FILE, "NUL bytes"),
    ("control-char", "tiers:\n  - {name: h\x01t, backend: memory, capacity: 8 blocks}\n", [], 2, FILE, "invalid YAML"),
    ("100MB-of-comments-cut", b"#" * (MAX_CONFIG_BYTES + 1), [], 2, FILE, "the limit is 1 MiB"),
    ("14MB-list", b"tiers: [" + b"1, " * (5 << 20) + b"1]\n", [], 2, FILE, "the limit is 1 MiB"),
    ("1MB-list-under-limit", "tiers: [" + "1," * 500_000 + "1]\n", [], 2, "tiers", "more than 10000 values"),
    ("5000-keys", "".join(f"k{i}: 1\n" for i in range(5000)) + "tiers:\n" + HOT, [], 2, FILE, "more than 10000 values"),
    ("3000-unknown-keys", "".join(f"k{i}: 1\n" for i in range(3000)) + "tiers:\n" + HOT, [], 2, "k0", "unknown key"),
    ("empty", "", [], 2, FILE, "empty"),
    ("only-comments", "# nothing\n", [], 2, FILE, "empty"),
    ("fifo-without-writer", make_fifo, [], 2, FILE, "empty"),
    ("directory", make_dir, [], 2, FILE, "directory"),
    ("/dev/zero", lambda tmp_path: "/dev/zero", [], 2, FILE, "the limit is 1 MiB"),
    ("missing", lambda tmp_path: str(tmp_path / "nope.yaml"), [], 2, FILE, "cannot read config"),
    ("two-documents", "tiers:\n" + HOT + "---\ntiers:\n" + HOT, [], 2, FILE, "single document"),
    ("python-tag", "tiers: !!python/object:os.system {}\n", [], 2, FILE, "invalid YAML"),
    ("undefined-alias", "tiers: *nope\n", [], 2, FILE, "undefined alias"),
    ("unhashable-key", "? [a, b]\n: 1\ntiers:\n" + HOT, [], 2, FILE, "invalid YAML"),
    ("root-scalar", "x" * 900_000, [], 2, FILE, "must be a mapping"),
    # a key written twice (YAML kept the last silently before)
    ("repeated-key", "tiers:\n  - {name: hot, backend: memory, capacity: 1GiB, capacity: 8 blocks}\n", [], 2,
     "tiers[0].capacity", "given twice (lines 2 and 2)"),
    ("repeated-top-key", "tiers:\n" + HOT + "tiers:\n" + HOT, [], 2, "tiers", "given twice"),
    # numbers with hundreds or thousands of digits (OverflowError before)
    ("block_tokens-300-digits", "block_tokens: " + "9" * 300 + "\ntiers:\n" + HOT, [], 2, "block_tokens",
     "far too large"),
    ("block_tokens-5000-digits", "block_tokens: " + "9" * 5000 + "\ntiers:\n" + HOT, [], 2, "block_tokens",
     "far too large"),
    ("block_tokens-60-digits", "block_tokens: " + "9" * 60 + "\ntiers:\n" + HOT, [], 2, "block_tokens",
     "positive integer up to"),
    ("block_tokens-sexagesimal", "block_tokens: " + "1:" * 100_000 + "1\ntiers:\n" + HOT, [], 2, "block_tokens",
     "far too large"),
    ("block_tokens-hex", "block_tokens: 0x" + "f" * 3000 + "\ntiers:\n" + HOT, [], 2, "block_tokens", "far too large"),
    ("block_tokens-float", "block_tokens: 1e400\ntiers:\n" + HOT, [], 2, "block_tokens", "positive integer"),
    ("block_bytes-400-digits", "block_bytes: 1" + "0" * 400 + "MiB\ntiers:\n" + HOT, [], 2, "block_bytes", "too large"),
    ("capacity-5000-digits", "tiers:\n  - {name: hot, backend: memory, capacity: " + "9" * 5000 + "GiB}\n", [], 2,
     "tiers[0].capacity", "too large"),
    ("capacity-decimals", "tiers:\n  - {name: hot, backend: memory, capacity: 1." + "5" * 3000 + "GiB}\n", [], 2,
     "tiers[0].capacity", "too large"),
    ("capacity-2EiB", "tiers:\n  - {name: hot, backend: memory, capacity: 2000000TiB}\n", [], 2, "tiers[0].capacity",
     "largest size"),
    ("capacity-huge-blocks", "tiers:\n  - {name: hot, backend: memory, capacity: " + "9" * 4000 + " blocks}\n", [], 2,
     "tiers[0].capacity", "too many"),
    ("capacity-huge-int", "tiers:\n  - {name: hot, backend: memory, capacity: " + "9" * 60 + "}\n", [], 2,
     "tiers[0].capacity", "ambiguous"),
    ("reserve-inf", "tiers:\n  - {name: hot, backend: memory, capacity: 8 blocks, reserve: .inf}\n", [], 2,
     "tiers[0].reserve", "between 0 and 0.5"),
    ("reserve-nan", "tiers:\n  - {name: hot, backend: memory, capacity: 8 blocks, reserve: .nan}\n", [], 2,
     "tiers[0].reserve", "between 0 and 0.5"),
    ("capacity-binary-tag", "tiers:\n  - {name: hot, backend: memory, capacity: !!binary aGVsbG8=}\n", [], 2,
     "tiers[0].capacity", "expected a size"),
    # nesting 100k deep (RecursionError and 200 kB of output before)
    ("100k-nested-lists", "tiers: " + "[" * 100_000 + "]" * 100_000 + "\n", [], 2, "tiers[0]", "nested more than 32"),
    ("50k-nested-maps", "tiers: " + "{a: " * 50_000 + "1" + "}" * 50_000 + "\n", [], 2, "tiers.a",
     "nested more than 32"),
    ("deep-at-root", "[" * 100_000 + "]" * 100_000 + "\n", [], 2, "[0]", "nested more than 32"),
    ("deep-block-style", "tiers:\n" + "".join("  " * i + "-\n" for i in range(1, 200)) + "  " * 200 + "1\n", [], 2,
     "tiers[0]", "nested more than 32"),
    ("deep-through-aliases", "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 60))
     + "tiers: *a59\n", [], 2, "a", "nested more than 32"),
    # alias bombs (hangs before: the error message printed the expanded value)
    ("laughs-in-block_tokens", laughs("block_tokens: *i\ntiers:\n" + HOT), [], 2, "block_tokens",
     "through YAML aliases"),
    ("laughs-in-capacity", laughs("tiers:\n  - {name: hot, backend: memory, capacity: *i}"), [], 2, "tiers[0].capacity",
     "through YAML aliases"),
    ("laughs-in-tiers", laughs("tiers: *i"), [], 2, "tiers", "through YAML aliases"),
    ("laughs-under-unknown-key", laughs("tiers:\n" + HOT + "x-junk: *i"), [], 2, "x-junk", "through YAML aliases"),
    ("laughs-inside-a-value", "block_tokens: [&a [1, 1, 1, 1, 1, 1, 1, 1], &b [*a, *a, *a, *a, *a, *a, *a, *a], "
     "&c [*b, *b, *b, *b, *b, *b, *b, *b], &d [*c, *c, *c, *c, *c, *c, *c, *c], [*d, *d, *d, *d, *d, *d, *d, *d]]\n"
     "tiers:\n" + HOT, [], 2, "block_tokens[4]", "through YAML aliases"),
    ("merge-key-bomb", merge_bomb(), [], 2, "m12.<<", "through YAML aliases"),
    ("recursive-alias-list", "tiers: &t [*t]\n", [], 2, "tiers[0]", "contains itself"),
    ("recursive-alias-map", "tiers:\n  - &t {name: hot, backend: memory, capacity: 8 blocks, me: *t}\n", [], 2,
     "tiers[0].me", "contains itself"),
    # long or odd values are quoted briefly
    ("900kB-tier-name", "tiers:\n  - {name: " + "x" * 900_000 + ", backend: memory, capacity: 8 blocks}\n", [], 2,
     "tiers[0].name", "not a valid tier name"),
    ("900kB-unknown-key", "tiers:\n  - name: hot\n    backend: memory\n    capacity: 8 blocks\n    ? " + "k" * 900_000
     + "\n    : 1\n", [], 2, "tiers[0].'kkkkkk", "unknown key"),
    ("900kB-backend", "tiers:\n  - {name: hot, backend: " + "m" * 900_000 + ", capacity: 8 blocks}\n", [], 2,
     "tiers[0].backend", "characters long"),
    ("900kB-module-name", "tiers:\n  - {name: hot, backend: 'a" + ".a" * 400_000 + ":X', capacity: 8 blocks}\n", [], 2,
     "tiers[0].backend", "characters long"),
    ("tiers-a-string", "tiers: " + "t" * 900_000 + "\n", [], 2, "tiers", "non-empty list"),
    ("tiers-a-mapping", "tiers: {name: hot}\n", [], 2, "tiers", "non-empty list"),
    ("backend-a-list", "tiers:\n  - {name: hot, backend: [memory], capacity: 8 blocks}\n", [], 2, "tiers[0].backend",
     "non-empty string"),
    ("cascade-a-mapping", "tiers:\n  - {name: hot, backend: memory, capacity: 8 blocks, cascade: {a: 1}}\n", [], 2,
     "tiers[0].cascade", "not one of"),
    ("name-null", "tiers:\n  - {name: null, backend: memory, capacity: 8 blocks}\n", [], 2, "tiers[0].name",
     "not a valid tier name"),
    ("root_dir-a-list", "tiers:\n" + HOT + "  - {name: disk, backend: file, capacity: 8 blocks, root_dir: [a]}\n",
     [], 2,
     "tiers[1].root_dir", ""),
    ("int-key", "1: 2\ntiers:\n" + HOT, [], 2, "1", "unknown key"),
    # code named by the config: located, never imported, by `config check`; imported with --import-code
    ("backend-a-function", module_tier("backend", "os:getcwd"), ["--import-code"], 2, "tiers[0].backend",
     "names a function, not a class"),
    ("policy-os-_exit", module_tier("policy", "os:_exit"), ["--import-code"], 2, "tiers[0].policy",
     "names a function, not a class"),
    ("policy-wrong-base", module_tier("policy", "json:JSONDecoder"), ["--import-code"], 2, "tiers[0].policy",
     "does not derive from kvtier.policies.base:CachePolicy"),
    ("backend-missing-attr", module_tier("backend", "os:NoSuchThing"), ["--import-code"], 2, "tiers[0].backend",
     "has no attribute 'NoSuchThing'"),
    ("backend-raises-on-import", module_tier("backend", "kvtier_boom_on_import:X"), ["--import-code"], 2,
     "tiers[0].backend", "importing module 'kvtier_boom_on_import' failed: RuntimeError: boom"),
    ("backend-module-missing", module_tier("backend", "kvtier_no_such_module.sub:X"), [], 2, "tiers[0].backend",
     "no module 'kvtier_no_such_module.sub' is installed"),
    ("backend-submodule-missing", module_tier("backend", "kvtier_sidefx_pkg.nosuch:X"), [], 2, "tiers[0].backend",
     "no module"),
    ("backend-not-a-name", module_tier("backend", "a b:c"), [], 2, "tiers[0].backend", "is not a backend name"),
    ("policy-not-a-name", module_tier("policy", "os:"), [], 2, "tiers[0].policy", "is not a policy name"),
]

# The existing field-by-field cases, through the command line (the one naming test code needs it imported).
CORPUS = [(f"broken-{i:02d}", text, ["--import-code"] if "tests.test_config:" in text else [], 2, path or FILE,
           fragment)
          for i, (text, path, fragment) in enumerate(BROKEN)] + HOSTILE

SIDE_EFFECT_MODULES = {
    # a module that raises when imported
    "kvtier_boom_on_import.py": "raise RuntimeError('boom')\n",
    # a package whose __init__ leaves a marker: `config check` must never run it
    "kvtier_sidefx_pkg/__init__.py": "import pathlib\npathlib.Path(__file__).with_name('IMPORTED').touch()\n",
    "kvtier_sidefx_pkg/mod.py": "from kvtier.tiers.memory import MemoryBackend as X\n",
}


@pytest.fixture
def side_effect_modules(tmp_path, monkeypatch):
    root = tmp_path / "mods"
    for name, text in SIDE_EFFECT_MODULES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in ("kvtier_boom_on_import", "kvtier_sidefx_pkg", "kvtier_sidefx_pkg.mod"):
        sys.modules.pop(name, None)


def _write_case(tmp_path, i: int, content) -> str:
    if callable(content):
        return content(tmp_path)
    path = tmp_path / f"case{i:03d}.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def _check_case(path: str, extra: list[str], code: int, field: str, fragment: str, capsys) -> str | None:
    """Runs `kvtier config check` in-process; returns what is wrong with its answer, or None."""
    try:
        rc = main(["config", "check", path, *extra])
    except BaseException as exc:  # noqa: BLE001 - what a user would see as a traceback
        capsys.readouterr()
        return f"raised {type(exc).__name__}: {str(exc)[:200]}"
    out, err = capsys.readouterr()
    lines = [line.strip() for line in err.splitlines()[1:]]
    want = path if field == FILE else field
    if rc != code:
        return f"exit {rc}, expected {code}: {err[:300]}"
    if "Traceback" in out + err:
        return f"printed a traceback: {err[:300]}"
    if len(out) + len(err) > 4000:
        return f"printed {len(out) + len(err)} characters"
    if not any((line.startswith(want) or field == FILE and want in line) and fragment in line for line in lines):
        return f"no line names {want!r} with {fragment!r}: {err[:400]}"
    return None


def test_hostile_corpus_every_case_a_clear_error_fast(tmp_path, capsys, side_effect_modules):
    failures, times = [], []
    started = time.perf_counter()
    for i, (case_id, content, extra, code, field, fragment) in enumerate(CORPUS):
        path = _write_case(tmp_path, i, content)
        t0 = time.perf_counter()
        problem = _check_case(path, extra, code, field, fragment, capsys)
        times.append((time.perf_counter() - t0, case_id))
        if problem:
            failures.append(f"{case_id}: {problem}")
    elapsed = time.perf_counter() - started
    slowest = ', '.join(f'{n} {t:.3f}s' for t, n in sorted(times)[-3:])
    print(f"{len(CORPUS)} cases in {elapsed:.2f}s; slowest: {slowest}")
    assert not failures, "\n".join(failures)
    assert elapsed < 5, f"corpus took {elapsed:.1f}s; slowest: {sorted(times)[-3:]}"
    assert not (side_effect_modules / "kvtier_sidefx_pkg" / "IMPORTED").exists()


def test_corpus_holds_every_broken_case_and_the_hostile_ones():
    ids = [c[0] for c in CORPUS]
    assert len(ids) == len(set(ids)) and len(CORPUS) == len(BROKEN) + len(HOSTILE) and len(HOSTILE) >= 60


def test_config_check_locates_named_code_without_running_it(tmp_path, capsys, side_effect_modules):
    """`config check` does not import a "package.module:Class" (not even its parent package);
    --import-code does, and checks the class."""
    config = tmp_path / "c.yaml"
    config.write_text(module_tier("backend", "kvtier_sidefx_pkg.mod:X"))
    marker = side_effect_modules / "kvtier_sidefx_pkg" / "IMPORTED"
    assert main(["config", "check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "tiers[0].backend: module of 'kvtier_sidefx_pkg.mod:X' found but not imported" in out
    assert not marker.exists() and "kvtier_sidefx_pkg" not in sys.modules
    assert main(["config", "check", "--import-code", str(config)]) == 0
    assert marker.exists() and "not imported" not in capsys.readouterr().out


@pytest.mark.parametrize("field, name, fragment", [
    ("policy", "os:_exit", "names a function, not a class"),
    ("backend", "os:getcwd", "names a function, not a class"),
    ("policy", "json:JSONDecoder", "does not derive from kvtier.policies.base:CachePolicy"),
    ("backend", "kvtier.policies.lru_pure:PureLRUCachePolicy", "does not derive from kvtier.tiers.base:Backend"),
])
def test_code_of_the_wrong_kind_is_a_config_error_at_load_and_at_build(field, name, fragment):
    with pytest.raises(ConfigError) as info:
        load_config_text(module_tier(field, name))
    assert [(p, fragment in m) for p, m in info.value.problems] == [(f"tiers[0].{field}", True)]
    tier = TierConfig("hot", name if field == "backend" else "memory", Capacity(blocks=8),
                      policy=name if field == "policy" else None)
    with pytest.raises(ConfigError) as info:  # built in code, never parsed: still refused, never called
        build_hierarchy(HierarchyConfig((tier,), block_bytes=64))
    assert [(p, fragment in m) for p, m in info.value.problems] == [(f"tiers[0].{field}", True)]


def test_only_the_first_problems_are_listed_and_the_rest_counted(tmp_path, capsys):
    text = "".join(f"k{i}: 1\n" for i in range(3000)) + "tiers:\n" + HOT
    with pytest.raises(ConfigError) as info:
        load_config_text(text)
    assert len(info.value.problems) == 21 and info.value.problems[-1] == ("", "2980 more problem(s) not shown")
    (tmp_path / "c.yaml").write_text(text)
    assert main(["config", "check", str(tmp_path / "c.yaml")]) == 2
    assert ": 3000 problem(s):" in capsys.readouterr().err


def test_anchors_that_share_values_still_load():
    text = """
tiers:
  - &hot {name: hot, backend: memory, capacity: 8 blocks, policy: arc}
  - {<<: *hot, name: warm, capacity: 16 blocks}
"""
    cfg = load_config_text(text)
    assert [(t.name, t.backend, t.policy, str(t.capacity)) for t in cfg.tiers] == [
        ("hot", "memory", "arc", "8 blocks"), ("warm", "memory", "arc", "16 blocks")]


def test_size_of_a_file_is_checked_before_reading_it(tmp_path):
    big = tmp_path / "sparse.yaml"
    with open(big, "wb") as f:
        f.truncate(10 << 30)  # 10 GiB, sparse: reading it would take long
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"config is 10737418240 bytes; the limit is 1 MiB"):
        load_config(big)
    assert time.perf_counter() - started < 1


def test_a_pipe_with_a_writer_is_read():
    """`kvtier config check <(cat x.yaml)`: the shell hands over /dev/fd/N, a pipe with a writer."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, ("tiers:\n" + HOT).encode())
        os.close(write_end)  # the writer is done: the reader sees the end of the file
        assert load_config(f"/dev/fd/{read_end}").tiers[0].name == "hot"
    finally:
        os.close(read_end)


def test_shared_and_cyclic_mappings_from_code_are_bounded():
    """parse_config of a mapping built in code (vLLM's inline config): sharing counts each use."""
    bomb: list = [1] * 9
    for _ in range(8):
        bomb = [bomb] * 9  # 9**9 values when expanded, a few hundred objects
    good = {"name": "hot", "backend": "memory", "capacity": "8 blocks"}
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": [good], "x-junk": bomb})
    [(path, message)] = info.value.problems
    assert path.startswith("x-junk[0]") and "more than 10000 values" in message
    cyclic = dict(good)
    cyclic["me"] = cyclic
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.me: contains itself"):
        parse_config({"tiers": [cyclic]})
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ConfigError, match=r"nested more than 32 deep"):
        parse_config({"tiers": deep})


def test_brief_quotes_any_value_shortly_and_fast():
    from kvtier.config.input import brief

    bomb: list = ["x"]
    for _ in range(40):
        bomb = [bomb, bomb]
    started = time.perf_counter()
    texts = [brief(v) for v in (10 ** 5000, "y" * 10_000_000, bomb, {"k" * 10**6: 1}, b"\0" * 10**6, 3, "ab")]
    assert time.perf_counter() - started < 1
    assert all(len(t) <= 60 for t in texts) and texts[-2:] == ["3", "'ab'"]
    assert texts[0] == "<an integer of about 5001 digits>"


@pytest.mark.parametrize("case_id", ["laughs-in-block_tokens", "100k-nested-lists", "block_tokens-5000-digits"])
def test_hostile_cases_through_a_real_process(tmp_path, case_id):
    import subprocess

    [(content, field, fragment)] = [(c[1], c[4], c[5]) for c in HOSTILE if c[0] == case_id]
    path = tmp_path / "c.yaml"
    path.write_text(content)
    result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "config", "check", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"  {field}" in result.stderr and fragment in result.stderr and len(result.stderr) < 4000


@pytest.mark.parametrize("libyaml", [True, False], ids=["libyaml", "pure-python"])
@pytest.mark.parametrize("case_id", ["100k-nested-lists", "50k-nested-maps", "laughs-in-capacity", "merge-key-bomb",
                                     "block_tokens-sexagesimal", "recursive-alias-map", "1MB-list-under-limit",
                                     "two-documents", "control-char"])
def test_both_yaml_parsers_apply_the_limits(libyaml, case_id):
    from kvtier.config.bounded_yaml import load_yaml

    [(content, field, fragment)] = [(c[1], c[4], c[5]) for c in HOSTILE if c[0] == case_id]
    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        parse_config(load_yaml(content, "t.yaml", libyaml=libyaml), "t.yaml")
    assert time.perf_counter() - started < 3
    want = "t.yaml" if field == FILE else field
    assert any((p.startswith(want) or want in m) and fragment in m for p, m in info.value.problems), info.value.problems


def test_a_byte_capacity_without_a_block_size_names_the_tier_at_build():
    """Before: ConfigError("capacity 1MiB needs the block size ...") with no field path."""
    with pytest.raises(ConfigError) as info:
        build_hierarchy(load_config_text("tiers:\n  - {name: m, backend: memory, capacity: 1MiB}\n"))
    assert info.value.problems[0][0] == "tiers[0].capacity" and "set block_bytes" in info.value.problems[0][1]
