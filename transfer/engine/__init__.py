"""The shells around the protocol: the control-plane thread, the backend's owning thread,
the manager that wires them, and the public sender/receiver handles."""
