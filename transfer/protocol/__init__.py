"""Pure protocol logic (sans-IO): head mapping, messages, tags, trackers and room state
machines. Nothing here touches a socket, a thread, a clock or a backend: inputs in,
decisions out."""
