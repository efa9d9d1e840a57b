"""attnprof tune and profiler.tune: the fastest attention backend per block, as a processor map (search.py: each
shape's backends alone; proof.py: the whole forward with the map against the best single backend; tuner.py: both,
for a model by name or a user's pipeline; store.py: the run and its map; check.py: make gpu-check's)."""
