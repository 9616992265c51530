"""How a run's agents start (locally, in a barrier stage, over Spark Connect)."""
