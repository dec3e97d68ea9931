"""Help texts of `kvtier bench`: what every column of its output means (no imports: argparse only)."""

from __future__ import annotations

HOPS_COLUMNS = """hop table (kvtier bench / bench hops), one row per hop and block size:
  hop          the transfer: engine->CPU, CPU->engine (GPU when the engine's KV cache is on CUDA),
               '... scattered' into/from a random permutation of CPU slots (a cache after churn),
               CPU->FILE, FILE->CPU, engine->FILE / FILE->engine 'staged' or 'direct' (the two
               engine<->file handlers), CPU->REMOTE, REMOTE->CPU
  block        bytes per block
  kvtier GB/s  median over --repeats rounds of kvtier's handler (1 GB = 1e9 bytes), bytes verified after
  spread       interquartile range / median of those rounds (with 3 rounds: half their range)
  baseline     what kvtier is compared with, measured in the same run on the same bytes, its rounds
               alternating with kvtier's: one contiguous copy (engine<->CPU), raw O_DIRECT write/read
               (CPU<->file), that plus one engine<->host copy (engine<->file), the client's raw
               SET/GET (remote hops)
  GB/s, spread the baseline's median and spread
  ratio        kvtier's median / the baseline's median; '?' marks a flagged ratio, not a finding
  flags        why: kvtier-unstable / baseline-unstable (spread over 25%), cache-resident (the bytes
               fit in the CPU cache), baseline-jump (the baseline over 1.5x off the same copy in the
               run's other rows), ratio-high (over 130%: the baseline is no ceiling), ratio-low
               (under 5%: a stall)
A line before the table names the directory and filesystem the file hops measured, and why that one."""

TRACE_COLUMNS = """trace table (kvtier bench / bench trace), one row per system, policy and capacity:
  system, policy  kvtier or vllm (--compare vllm); the first tier's policy ('+hints': replayed with
                  retention hints); 'offline Belady': the optimum
  tier0 blocks    the first tier's capacity in blocks; vLLM's one tier holds kvtier's total across
                  tiers at that size (as the optimum): over several tiers a note and its per-tier
                  column say how many blocks
  hit rate        blocks found / blocks looked up, over the whole hierarchy
  block ops/s     lookups + stores the manager answered per second
  CPU us/blk      the manager's CPU time per trace block
  per tier        each tier's share of the hit rate

Traces: --trace FILE reads a Mooncake-format JSONL file (one request per line with 'hash_ids'), as
published by the Mooncake project (kvcache-ai/Mooncake, its FAST'25 traces); --trace sample uses a
few hundred requests of its conversation trace shipped with kvtier; without --trace, a built-in
multi-turn workload is generated, or --workload agentic|chat|mixed-scans: sessions with arrival times.

Sessions table (--workload agentic|chat|mixed-scans, or --trace with --hints), one row per capacity:
  lru, prefix-freq, ...   kvtier's hit rate without hints; '+hints': each request carries its
                          session's hint (retain_s, session_ended on the last turn; a one-time
                          request: a session ended at once), retention running on the trace's
                          clock (--hints on|both, --retain-s)
  vllm lru, vllm arc      vLLM's own manager with as many blocks in all (--compare vllm)
  ends known              an LRU that knows every session's end: the most session_ended can buy
  optimum                 the offline optimum at that capacity
  gap closed P            (P+hints - vLLM's best) / (optimum - vLLM's best): 1 = all of it
                          (with --compare vllm only)
A note says when no session has two turns (hints then keep nothing for a next turn).
Then, per policy without hints: its worst margin to vLLM's best over the capacities, whether it is
within 0.002 of it, and whether it is above it at every capacity."""

BENCH_EPILOG = HOPS_COLUMNS + "\n\n" + TRACE_COLUMNS
