"""The planner: per-call figures from a meta-device forward (calls.py)."""
from .calls import format_plan, plan, predicted_need_bytes, totals  # noqa: F401
