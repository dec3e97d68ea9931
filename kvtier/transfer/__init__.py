"""Moving bytes: the handlers per (source, destination) spec pair, the registry of them, the routers and the planes."""
