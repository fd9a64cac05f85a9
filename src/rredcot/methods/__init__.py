"""Credit methods behind one registry."""
