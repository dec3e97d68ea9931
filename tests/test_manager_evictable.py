"""The manager's evictable accounting (issue 19 item 2) stays exact under every manager operation:
the keys each tier's policy counts as pinned are exactly its resident blocks with `ref_cnt != 0`.
Runs the manager state machine of test_manager_state (deferred and failing copies, promotions,
loads held open) with this extra invariant, for LRU (pinned blocks set aside) and prefix-freq."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import invariant
from test_manager_state import BLOCK, ManagerMachine


class AccountingMachine(ManagerMachine):
    @invariant()
    def pinned_set_is_exact(self):
        for tier in self.m.tiers:
            table = tier.table
            truth = {k for k in table.keys() if table.get(k).ref_cnt != 0}
            pinned = table.pinned_keys()
            assert pinned == truth, f"{tier.name}: counted {pinned ^ truth} wrongly"
            evictable = sum(1 for k in table.keys() if table.get(k).ref_cnt == 0)
            assert table.evictable_count() == evictable
            told = getattr(table, "held", None)  # the pure table: what its order was told
            if told is not None:
                assert told == truth, f"{tier.name}: the order was told {told ^ truth} wrongly"


class LRUAccounting(AccountingMachine):
    HIERARCHY = dict(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34, hot_policy="lru")


class PureLRUAccounting(AccountingMachine):
    """`lru`'s pure-Python fallback (the registered `lru` is the compiled index here)."""

    HIERARCHY = dict(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34,
                     hot_policy="kvtier.policies.lru_pure:PureLRUCachePolicy")


class PrefixAccounting(AccountingMachine):
    HIERARCHY = dict(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34, hot_policy="prefix-freq")


FAST = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLRUAccounting = LRUAccounting.TestCase
TestLRUAccounting.settings = FAST
TestPureLRUAccounting = PureLRUAccounting.TestCase
TestPureLRUAccounting.settings = FAST
TestPrefixAccounting = PrefixAccounting.TestCase
TestPrefixAccounting.settings = FAST
TestARCAccounting = AccountingMachine.TestCase
TestARCAccounting.settings = FAST
