"""The planner: per-call figures (calls.py) and the whole forward's peak memory on fake tensors (forward.py)."""
from .calls import format_plan, plan, totals  # noqa: F401
