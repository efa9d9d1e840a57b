"""Measuring: timers, memory probes and NVML (probes.py), and one cell (cell.py)."""
