"""What runs on a node: in a barrier Spark task, or on the driver's machine in local
mode (the agent, the warm fork server, process handling). Never imports driver/,
spark/ or launchers/."""
