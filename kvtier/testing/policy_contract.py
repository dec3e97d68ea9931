"""The clauses of the `CachePolicy` contract that `PolicyTests` checks, one sentence each.

Every failing check of `PolicyTests` starts its message with the clause it enforces, so a
third-party policy that fails the suite is told which rule it broke, not only which line. The
README lists the same sentences (tests/test_docs.py keeps the two equal). Plain data: importing
this module needs neither pytest nor hypothesis.
"""

from __future__ import annotations

CAPACITY = "the constructor must raise ValueError for a capacity < 1"
GET = "get(key) must return the block inserted under key, and None for an absent key"
RESIDENT = "len() and keys() must be exactly the resident blocks"
REMOVE = "remove(key) must drop that block and no other"
REMOVE_ABSENT = "remove() of an absent key must be a no-op"
INSERT_MANY = "insert_many(keys, blocks) must leave exactly the state of a loop of insert()"
TOUCH = "touch() must ignore absent keys and never drop or replace a resident block"
HIT_OUTLIVES = ("a touched block must outlive blocks stored once and never touched "
                "(unless the suite declares keeps_hit_blocks = False)")
EVICT_NONPOSITIVE = "evict(0) and evict(-1) must return [] and change nothing"
EVICT_EXACT = ("evict(n) must remove and return exactly n distinct resident blocks, each "
               "(key, the block inserted under it)")
EVICT_REFUSED = "evict(n) with fewer than n evictable blocks must return None and change nothing"
PINNED = "a pinned (ref_cnt != 0) or protected block must never be evicted"
UNPINNED = "a block whose ref_cnt is back to 0 must be evictable again"
REF_CNT_VIA_GET = "ref_cnt set on what get() returns must be seen by every later get() and decision"
CANDIDATES = ("victims(n) must name evictable blocks only, each once "
              "(all of them unless the suite declares predicts_victims = False)")
CANDIDATES_PURE = "victims(n, skip) must change nothing"
CANDIDATES_ORDER = "victims(n, skip) must be what evict(n, skip) takes, in order (when predicts_victims is declared)"
VICTIM_KEYS = "victims(n) must be the first n keys of victims(len(policy))"
CLEAR = "clear() must empty the policy and leave it usable"

# In the order the README lists them.
POLICY_CLAUSES = (CAPACITY, GET, RESIDENT, REMOVE, REMOVE_ABSENT, INSERT_MANY, TOUCH, HIT_OUTLIVES,
                  EVICT_NONPOSITIVE, EVICT_EXACT, EVICT_REFUSED, PINNED, UNPINNED, REF_CNT_VIA_GET,
                  CANDIDATES, CANDIDATES_PURE, CANDIDATES_ORDER, VICTIM_KEYS, CLEAR)
