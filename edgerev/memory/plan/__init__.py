"""Plans that keep a training step under a budget: the solvers' proposals checked by the accounting.

:mod:`.autoplan` (floor, solve, check exactly, shrink, widen), :mod:`.device_fit` (the plan tried on the CUDA
allocator under the cap, and made again under less while it runs out), :mod:`.progress` (a line per phase once
planning takes a while).
"""
