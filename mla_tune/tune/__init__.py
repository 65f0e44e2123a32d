"""Tuning: the search (grid / optuna TPE), the sweep over buckets, distributed sweeps, choosing winners and emitting the tuned config."""
