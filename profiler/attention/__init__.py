"""What runs in an attention call and what records it: the backends (backends.py), the processors that call them
(processor.py, fused.py, chunked.py) and the recorder that wraps each call (recorder.py)."""
