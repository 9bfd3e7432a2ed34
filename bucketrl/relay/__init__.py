"""The regional relay (``bucketrl relay``): generators of one region talk to it instead of the home proxy.

It serves adapter version downloads from its own disk cache (pulled once per version over the slow link,
verified by sha256 when written, one upstream fetch however many generators ask at once) and forwards every
other call (leases, prompts, submits, claims, long-polls, metrics) to the home proxy as a streaming reverse
proxy. It holds no token: each caller's own ``Authorization`` goes upstream, and every cached download is
first authorized by the home proxy (a conditional GET answered 304 with only the sha256). See docs/scale.md.
"""
