"""A wide-area network on one machine, for tests and benchmarks (root only): a "home" network namespace where the
proxy, Redis and the bucket run, and region namespaces ("a", "b", ...) for generators, each region joined to home
by its own veth link with a set bandwidth and a set round trip, and a way to drop a link for N seconds.

- Bandwidth is the kernel's: a ``tbf`` qdisc on both ends' egress (:mod:`.topology`).
- Delay is emulated in userspace, because the ``netem`` qdisc does not exist on these machines: a TCP relay
  (:mod:`.delay`) holds each chunk for the one-way delay, per direction, in order, with back-pressure. Only
  traffic through a relay is delayed, and TCP's own round trip (its congestion control, the handshake) stays
  short; :mod:`.delay` lists what that does not reproduce.
- A dropped link black-holes its packets (nft, default) or has its interfaces down (:mod:`.drop`).
- Everything lives in namespaces named after the owning process; closing the lab, atexit, SIGTERM, or the next
  lab's start (for an owner that was SIGKILLed) deletes them (:mod:`.cleanup`).

The path of one byte a generator in region a sends to the proxy in home (``relay = lab.expose("a", 8080)``):

1. the generator (``ip netns exec <a> ...``) writes to its socket connected to ``relay.address``
   (``10.77.1.1:<port>``, home's end of link a);
2. region a's kernel queues it on interface ``home`` (the veth end in a), whose ``tbf`` releases it at the
   link's rate; the veth hands it to its peer ``to-a`` in home;
3. home's kernel delivers it to the relay's accepted socket; the relay reads it, holds it for half the RTT,
   then writes it to its own connection to ``127.0.0.1:8080``;
4. over home's loopback (no rate limit, no delay) to the proxy.

The reply goes back the same way: loopback to the relay, held half the RTT, out of ``to-a`` through home's
``tbf``, into region a. So each direction is delayed once and rate limited once.

    sudo python -m bucketrl.sim.netlab up --regions a,b --rtt-ms 100 --mbit 200 --expose 8080

prints the namespaces, addresses and relays as JSON and holds them until Ctrl-C (or SIGTERM).
``python -m bucketrl.sim.netlab check --rtt-ms 100 --mbit 200`` measures what a lab's links deliver on this
machine now (RTT and download rate through a relay); ``sweep`` removes labs whose owner died; ``drop`` cuts a link
of a lab held by ``up`` for N seconds.
"""

from bucketrl.sim.netlab.cleanup import sweep
from bucketrl.sim.netlab.topology import HOME, Lab, Link, LinkSpec, Relay, uniform

__all__ = ["HOME", "Lab", "Link", "LinkSpec", "Relay", "sweep", "uniform"]
