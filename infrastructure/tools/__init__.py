"""Tools around the service: bench, the fleet simulation, the fault-injection run (verify)."""
