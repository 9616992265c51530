"""What runs inside a rank: the per-rank supervisor, the rank process, ``report()``.
Never imports driver/, spark/ or launchers/."""
