"""A plugin loaded after tests.faults (ATTNPROF_PLUGINS=tests.faults,tests.fast_resume): fault-slow without its wait,
for the job that resumes a run whose fault-slow cell was stopped mid-run. The cell keeps its identity (its backend's
name); the 20 s of waiting that the stop needed would only hold the resume up."""
from dataclasses import replace

from profiler.attention.backends import BACKENDS, register

register(replace(BACKENDS["fault-slow"], description="test: fault-slow without its wait (SDPA)",
                 factory=BACKENDS["sdpa"].factory))
