"""The clauses of the `Backend` contract that `BackendTests` checks, one sentence each.

Every failing check of `BackendTests` starts its message with the clause it enforces; the README
lists the same sentences (tests/test_docs.py keeps the two equal). Plain data.
"""

from __future__ import annotations

DECLARES = ("a backend must declare spec_type (a BlockIDsLoadStoreSpec subclass), a non-empty medium and "
            "a bool persistent, and keep the num_blocks and block_bytes it was made with")
STARTS_FREE = "a new backend must have every slot free"
ALLOCATE = "allocate_blocks(keys) must return one BlockStatus per key and lower the free count by as many"
BEING_WRITTEN = "a newly allocated block must have ref_cnt -1 (being written)"
FREE = "free() and free_many() must raise the free count by exactly the blocks freed"
UNIQUE_SLOTS = "no slot may be handed out twice while allocated, and every slot is in 0..num_blocks-1"
NO_OVERALLOCATION = "with no slot free, allocate_blocks() must hand out nothing (or raise)"
REUSE = "freed slots must be handed out again, never a slot still held"
SPEC = ("get_load_store_spec(keys, blocks) must return a spec of spec_type naming the blocks' slots in "
        "the order given, and allocate or free nothing")
BYTES = "a block must give back the bytes written to it"
STILL_VALID = ("still_valid() must answer a bool and change nothing (True, on a persistent backend, for a "
               "block it wrote and can read)")
RECOVER_NEW = "recover() on a new backend must find nothing and claim no slot"
CLOSE = "close() must succeed twice"
PERSISTENT = ("a persistent backend must find again, after close() and reopen(), exactly the blocks it "
              "held: ready, their slots claimed and never handed out again, their bytes intact")

# In the order the README lists them.
BACKEND_CLAUSES = (DECLARES, STARTS_FREE, ALLOCATE, BEING_WRITTEN, FREE, UNIQUE_SLOTS, NO_OVERALLOCATION, REUSE,
                   SPEC, BYTES, STILL_VALID, RECOVER_NEW, CLOSE, PERSISTENT)
