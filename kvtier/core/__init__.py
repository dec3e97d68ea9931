"""The words every layer uses: keys, specs, types, the manager protocol, errors, limits, units."""
