"""The broker's rooms (see :mod:`autogpu_jupyter.broker`, which wires them together).

``book``: the lease book (live leases and tickets, orphans, the waiting line; no asyncio);
``picklock``: the fair pick lock; ``ops``: the protocol's ops, each validate then execute;
``views``: what the broker shows of the book; ``connections``: the life of a connection;
``fleet``: the broker's own snapshots; ``restore``: the journal written and replayed, orphans
and their liveness; ``peers``: who holds a lease's socket; ``bookstore``: the book as a lease
store; ``identity``: who a uid is (subordinate uids are their owner); ``journal``: what
survives a restart; ``net``: the listening socket, accepting, the connection caps;
``tenants``: the tenants (named by the socket a connection came through), their table and their
sockets. Only the broker (and the tests) import them, except ``tenants``: also the
``autogpu broker tenant`` command and the JupyterHub hook (``autogpu_jupyter.hub``).
"""
