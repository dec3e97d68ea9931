"""Type stub of the compiled job planner (kvtier/transfer/handlers/_job_plan.pyx)."""

from typing import Any

def plan_job(block_ids: list, group_sizes: list, block_indices: list | None, slots: list, seg_first: Any,
             engine_base: Any, engine_stride: Any, page: Any, place: Any, bpc: int, engine_blocks: int,
             region_base: int, region_stride: int, region_rows: int, to_cpu: bool) -> tuple[Any, Any, Any]: ...
