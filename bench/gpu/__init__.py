"""The real-GPU run: payload, driver, and the tables beside the simulator (see README.md here)."""
