"""The benchmark programs: each prints its table and writes its JSON (and plot)."""
