"""The run on the driver (the caller's process): planning, the collector, tracking."""
