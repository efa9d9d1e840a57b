"""The profiling service: a Ray head and the dashboard (serve.py), profiles queued as Ray Jobs (jobs.py)."""
