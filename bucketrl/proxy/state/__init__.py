"""Redis-backed state of the proxy, one module per concept; key names live in ``bucketrl.proxy.keys``.

Every multi-key decision that two requests could race (publish vs. fencing, lease vs. GC) is a single
Lua script, so Redis serialises it; see each module's docstring for its invariant.
"""
