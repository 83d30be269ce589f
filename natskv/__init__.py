"""The NATS KV operations, written once for the gateway and the workers.

Both processes read and write the same JetStream KV buckets (futures, sessions, leases,
heartbeats, ...), with the same semantics: a compare-and-set on a key's revision, a delete that
leaves a marker, an erase that leaves none, and listings made of stream-info requests instead of
nats-py's KV watcher. `natskv.store.KvStore` is that one implementation, with the errors worth
another attempt (`TRANSIENT_ERRORS`); the gateway's `twinkle_async.bus.Bus` and the workers'
`workers.bus.WorkerBus` build on it, each passing its own retry policy (how long a call keeps
trying while NATS is away differs: seconds for an HTTP request, minutes for a computed outcome).

It lives apart from both because neither may import the other (`tests/test_static.py`), and not
in `protocol/`, which does no I/O. It imports only nats and `protocol`.
"""
