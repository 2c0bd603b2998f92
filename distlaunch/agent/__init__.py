"""Per-node supervisor: worker processes, their output, the group's life cycle and the
restart policy."""
