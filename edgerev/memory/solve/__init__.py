"""Pure cost types and solvers: no torch, so a plan can be read, checked and solved anywhere.

:mod:`.costs` (cost curves, per-stage profiles, plans), :mod:`.knapsack` (stage modes under a budget: a
multiple-choice knapsack), :mod:`.segments` (checkpoint segments of a chain: Re-forwarding's linear solver).
"""
