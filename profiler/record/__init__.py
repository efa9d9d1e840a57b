"""A user's own generation, profiled as it runs: from Python (session.profile) and from an unmodified script
(script.py: attnprof record)."""
