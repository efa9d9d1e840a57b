"""What builds the model under test: the named U-Nets (models.py) and their kinds (kinds.py), the inputs of a call
(workload.py), weights (weights_init.py, checkpoint.py) and the parts added to a pipeline (adapters.py)."""
