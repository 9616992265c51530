"""Tests of the Airflow integration (a real Airflow with a temporary SQLite metadata DB)."""
