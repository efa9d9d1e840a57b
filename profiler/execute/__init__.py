"""Sweeps: the grid (grid.py), running it (sweep.py) on local workers (local.py, worker.py) or Ray (ray.py)."""
