"""Recency per request, as vLLM 0.32 records it (issue 29, items 3 and 4).

Each scenario is one call sequence, replayed on vLLM's own `CPUOffloadingManager` and on kvtier's
vLLM adapter (`KVTierOffloadingManager` over a one-tier hierarchy) or `LRUOffloadingManager`; the
blocks each store evicts and the final lookups must be the same. Where kvtier deliberately differs
(docs/policies.md, "vLLM's recency"), a test pins the difference.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

TOKENS = 16  # tokens per block: a key's position is its end token


def _key(name: str, group: int = 0):
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(name.encode().ljust(32, b"\0"), group)


def _vllm(policy: str, blocks: int):
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(num_chunks=blocks, cache_policy=policy)


def _adapter(policy: str, blocks: int):
    from kvtier.config import parse_config
    from kvtier.control.hierarchy import build_hierarchy
    from kvtier.integrations.vllm.manager import KVTierOffloadingManager

    config = parse_config({"tiers": [{"name": "cpu", "backend": "cpu", "capacity": f"{blocks} blocks",
                                      "policy": policy}]})
    return KVTierOffloadingManager(build_hierarchy(config, block_bytes=64, dry_run=True))


def _lru_manager(policy: str, blocks: int):
    from kvtier import LRUOffloadingManager
    from kvtier.tiers.memory import SlotBackend

    assert policy == "lru"
    return LRUOffloadingManager(SlotBackend("cpu", blocks, 0, block_size=TOKENS))


def _replay(manager, script):
    """Run `script` on `manager`; returns what each store evicted (a set; None: no room) and each
    lookup's answer, in order. Steps: ("new", req, prompt) with the prompt's key names (positions
    recorded as vLLM's scheduler records them, per group), ("load", req, names), ("store", req,
    names), ("finish", req), ("reset",), ("lookup", names)."""
    from vllm.v1.kv_offload.base import ReqContext

    contexts: dict[str, ReqContext] = {}
    seen = []
    for step in script:
        op = step[0]
        if op == "new":
            ctx = contexts[step[1]] = ReqContext(step[1])
            counts: dict[int, int] = {}
            for name in step[2]:
                key = _parse(name)
                group = int.from_bytes(key[-4:], "big")
                counts[group] = counts.get(group, 0) + 1
                ctx.set_offload_key_position(key, counts[group] * TOKENS)
            manager.on_new_request(ctx)
        elif op == "load":
            keys = [_parse(n) for n in step[2]]
            manager.prepare_load(keys, contexts[step[1]])
            manager.complete_load(keys, contexts[step[1]])
        elif op == "store":
            out = manager.prepare_store([_parse(n) for n in step[2]], contexts[step[1]])
            if out is None:
                seen.append(None)
                continue
            manager.complete_store(out.keys_to_store, contexts[step[1]])
            seen.append({_name(k) for k in out.evicted_keys})
        elif op == "finish":
            manager.on_request_finished(contexts[step[1]])
        elif op == "reset":
            manager.reset_cache()
        elif op == "lookup":
            ctx = ReqContext("lookup")
            seen.append([manager.lookup(_parse(n), ctx).name for n in step[1]])
    return seen


def _parse(name: str):
    """"a" -> key a of group 0; "a/1" -> key a of group 1."""
    base, _, group = name.partition("/")
    return _key(base, int(group or 0))


def _name(key) -> str:
    group = int.from_bytes(key[-4:], "big")
    base = key[:-4].rstrip(b"\0").decode()
    return base if group == 0 else f"{base}/{group}"


def _request(req, prompt, load=(), stores=()):
    """A whole request: its prompt, a load of `load`, one store call per item of `stores`, its end."""
    steps = [("new", req, prompt)]
    if load:
        steps.append(("load", req, list(load)))
    steps += [("store", req, list(s)) for s in stores]
    return steps + [("finish", req)]


LOOKUP = ("lookup", ["a", "b", "c", "d", "e", "x", "y"])

# A request's loads are applied when it finishes: while R3 runs, a and b keep the recency they had.
DEFERRED_LOAD = [*_request("r1", ["a", "b"], stores=[["a", "b"]]),
                 *_request("r2", ["c", "d"], stores=[["c", "d"]]),
                 ("new", "r3", ["a", "b", "e"]), ("load", "r3", ["a", "b"]),
                 *_request("r4", ["x"], stores=[["x"]]), ("finish", "r3"),
                 *_request("r5", ["y"], stores=[["y"]]), LOOKUP]
# Blocks a request offers again while readable (its GPU prefix-cache hits) are reuses.
REOFFERED = [*_request("r1", ["a", "b"], stores=[["a", "b"]]),
             *_request("r2", ["c", "d"], stores=[["c", "d"]]),
             *_request("r3", ["a", "b", "e"], stores=[["a", "b", "e"]]),
             *_request("r4", ["x"], stores=[["x"]]), LOOKUP]
# A request's accesses are applied once, head first: the loaded prefix outranks the request's tail.
LOAD_THEN_STORE = [*_request("r1", ["a", "b"], stores=[["a", "b"]]),
                   *_request("r2", ["c", "d"], stores=[["c", "d"]]),
                   *_request("r3", ["c", "d", "e"], load=["c", "d"], stores=[["e"]]),
                   *_request("r4", ["x", "y"], stores=[["x", "y"]]), LOOKUP]
# A request reading back a block it stored itself does not make that block frequent (ARC's T2).
OWN_READ = [("new", "r1", ["a", "b"]), ("store", "r1", ["a", "b"]), ("load", "r1", ["a"]), ("finish", "r1"),
            *_request("r2", ["c"], stores=[["c"]]),
            *_request("r3", ["d", "e"], stores=[["d", "e"]]), LOOKUP]
# Two KV-cache groups in one call (item 4): the call is one prefix per group; both tails go first.
HYBRID = [*_request("r1", ["a", "b", "a/1", "b/1"], stores=[["a", "b", "a/1", "b/1"]]),
          *_request("r2", ["x", "y"], stores=[["x", "y"]]),
          ("lookup", ["a", "b", "a/1", "b/1", "x", "y"])]
# A prompt stored in two calls (chunked prefill): its end orders the whole prompt, head first.
CHUNKED = [*_request("r1", ["a", "b", "c", "d"], stores=[["a", "b"], ["c", "d"]]),
           *_request("r2", ["x", "y"], stores=[["x", "y"]]), LOOKUP]

SCENARIOS = {"deferred_load": (DEFERRED_LOAD, 4), "reoffered": (REOFFERED, 4),
             "load_then_store": (LOAD_THEN_STORE, 5), "own_read": (OWN_READ, 3), "hybrid": (HYBRID, 4),
             "chunked": (CHUNKED, 4)}
# kvtier's adapter with `arc` places a request's new blocks by their insertion, tail first per
# call, and does not reorder them at the request's end (a touch would make them frequent).
ARC_DIFFERS = {"chunked"}


@pytest.mark.parametrize(("policy", "scenario"),
                         [(policy, scenario) for policy in ("lru", "arc") for scenario in sorted(SCENARIOS)
                          if not (policy == "arc" and scenario in ARC_DIFFERS)])  # (those: pinned apart)
def test_adapter_evicts_what_vllm_evicts(policy, scenario):
    """vLLM's answers, except the deliberate differences (`ARC_DIFFERS`), each pinned by its own
    test (test_arc_chunked_prompt_keeps_insertion_order)."""
    script, blocks = SCENARIOS[scenario]
    assert _replay(_adapter(policy, blocks), script) == _replay(_vllm(policy, blocks), script)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_lru_manager_evicts_what_vllm_lru_evicts(scenario):
    script, blocks = SCENARIOS[scenario]
    assert _replay(_lru_manager("lru", blocks), script) == _replay(_vllm("lru", blocks), script)


def test_hybrid_call_evicts_both_tails():
    """The issue's example: for [g0-head, g0-tail, g1-head, g1-tail] vLLM evicts both tails."""
    script, blocks = SCENARIOS["hybrid"]
    for manager in (_adapter("lru", blocks), _adapter("arc", blocks), _lru_manager("lru", blocks)):
        assert _replay(manager, script)[1] == {"b", "b/1"}


def test_arc_chunked_prompt_keeps_insertion_order():
    """Pinned difference: vLLM's ARC reorders a request's new blocks at its end (head first);
    kvtier's keeps them where their tail-first insertion put them, call by call, so the first
    call's blocks are older than the second's."""
    script, blocks = SCENARIOS["chunked"]
    assert _replay(_vllm("arc", blocks), script)[2] == {"c", "d"}
    assert _replay(_adapter("arc", blocks), script)[2] == {"a", "b"}


def test_arc_ghost_hit_follows_the_paper():
    """Pinned difference: kvtier's ARC is the paper's. A block stored again while its key is in
    the ghost list B1 enters T2, and the target size adapts at its insertion, after the eviction
    that made room; vLLM's inserts it into T1 and adapts first. Here b comes back (step 5): vLLM
    then keeps T1 at two blocks and evicts d from it at step 6, kvtier evicts f from T2."""
    names = ["b", "f", "f", "e", "d", "b", "e", "f"]
    script = [step for i, n in enumerate(names) for step in _request(f"r{i}", [n], stores=[[n]])]
    assert _replay(_vllm("arc", 3), script)[6] == {"d"}
    assert _replay(_adapter("arc", 3), script)[6] == {"f"}


def test_a_reset_forgets_open_requests():
    """vLLM's cache generation: accesses recorded before `reset_cache` are not applied after it
    (here r2's load of b, which would otherwise make b the most recent when r2 ends)."""
    script = [*_request("r1", ["a", "b"], stores=[["a", "b"]]), ("new", "r2", ["a", "b"]),
              ("load", "r2", ["b"]), ("reset",), *_request("r3", ["x", "b"], stores=[["x", "b"]]),
              ("finish", "r2"), *_request("r4", ["y"], stores=[["y"]]), ("lookup", ["b", "x", "y"])]
    for policy in ("lru", "arc"):
        assert _replay(_adapter(policy, 2), script) == _replay(_vllm(policy, 2), script)
    assert _replay(_lru_manager("lru", 2), script) == _replay(_vllm("lru", 2), script)


def test_a_hybrid_store_answers_in_the_offers_order():
    """vLLM's scheduler lists a store job's engine blocks group after group and pairs them with the
    answer's slots in order: the keys to store (and their slots) keep the offer's order, though
    they are inserted one prefix per group. Each key's slot is the one a later load of it reads."""
    from vllm.v1.kv_offload.base import ReqContext

    manager = _adapter("lru", 8)
    offer = [_parse(n) for n in ("a", "b", "c", "a/1", "b/1", "c/1")]
    ctx = ReqContext("r")
    for group in (0, 1):
        for i, name in enumerate("abc"):
            ctx.set_offload_key_position(_key(name, group), (i + 1) * TOKENS)
    out = manager.prepare_store(offer, ctx)
    assert out.keys_to_store == offer
    manager.complete_store(offer, ctx)
    slots = dict(zip(offer, out.store_spec.block_ids))
    assert len(set(slots.values())) == len(offer)
    for key in offer:
        assert list(manager.prepare_load([key], ctx).block_ids) == [slots[key]]
