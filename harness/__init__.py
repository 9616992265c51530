"""What the tests and the benchmarks share to drive real services (Airflow's scheduler and API
server, served Prefect deployments) and to watch the processes of a run. Outside the wheel:
neither the package nor a user needs it."""
