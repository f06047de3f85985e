"""What a training step holds, counted on real or fake tensors.

:mod:`.tracker` (live tensor bytes, and the CPU budget), :mod:`.microbatch` (the step's micro-batch loop),
:mod:`.account` (what a step under a recipe holds at its peak: the one accounting), :mod:`.peak` (a step's peak,
real or fake), :mod:`.profile` (per-stage bytes and seconds, cached), :mod:`.analytic` (bytes per pixel from the
structure).
"""
