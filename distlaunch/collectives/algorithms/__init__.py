"""The collective algorithms, per transport, and the backends that run them.

- :mod:`.tcp`: ring, tree, Bruck and direct algorithms over the TCP transport
  (point-to-point messages between group members);
- :mod:`.shm`: the same operations on a group's shared-memory channel (every member on
  this node);
- :mod:`.backend`: the TCP and shared-memory backends (one per group, chosen by its
  first collective) that run an op-table entry with its transport's algorithm;
- :mod:`.hierarchy`: the backend of groups spanning nodes (shared memory inside each
  node, TCP between them).

Each algorithm registers itself on its op-table entry (:func:`~..optable.implements`).
"""
