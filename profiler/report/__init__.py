"""Reports of stored runs: attnprof show and runs (show.py)."""
