"""The broker's parts that are not its protocol (see :mod:`autogpu_jupyter.broker`).

``identity``: who a uid is (subordinate uids are their owner); ``journal``: what survives a
restart, and who still holds a lease's socket; ``net``: the listening socket, accepting, the
connection caps; ``tenants``: the tenants (names given by the socket a connection came through),
their table and their sockets. Only the broker imports them, except ``tenants``: also the
``autogpu broker tenant`` command and the JupyterHub hook (``autogpu_jupyter.hub``).
"""
