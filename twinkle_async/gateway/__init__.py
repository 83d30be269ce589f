"""The Tinker HTTP API (aiohttp): one route table of module-level handlers, typed app state."""
