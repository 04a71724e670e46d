"""``remat bench``: every strategy on one workload, measured side by side.

Peak activation memory is measured per strategy in a process of its own (forked from one that
imported torch once, see ``_child.ForkServer``), so that one run's allocations never pollute the
next; step times are measured in one process, alternating the strategies step by step, and
reported as ratios to the plain step (see ``measure.py``).
"""

__all__: list[str] = []
