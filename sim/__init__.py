"""Simulation support shared by the unit tests and the examples: the pure protocol driven
without sockets or memory (fleet.py), a seeded control-plane network (network.py), and the
memory an object graph holds (deep_size.py)."""
