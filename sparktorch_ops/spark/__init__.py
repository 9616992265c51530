"""Spark on the driver: the one session factory, preflight, DataFrame input, JVM log."""
