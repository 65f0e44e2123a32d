"""The results store (results.db) and merging other hosts' stores into it."""
