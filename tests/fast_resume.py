"""A plugin loaded after tests.faults (ATTNPROF_PLUGINS=tests.faults,tests.fast_resume): fault-slow and
fault-slow-big without their wait, for the job that resumes a run whose slow cells were stopped mid-run. The cells
keep their identity (their backend's name); the waiting that the stop needed would only hold the resume up."""
from dataclasses import replace

from profiler.attention.backends import BACKENDS, register

for _name in ("fault-slow", "fault-slow-big"):
    register(replace(BACKENDS[_name], description=f"test: {_name} without its wait (SDPA)",
                     factory=BACKENDS["sdpa"].factory))
