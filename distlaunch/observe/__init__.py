"""Observing a running job from outside its workers: every rank's Python stack
(``stacks``), grouped and explained (``group``), compact per-rank records for
``distlaunch top`` (``records``) and their table (``table``), and merging identical
output lines of many ranks (``dedup``).

This package sits beside ``agent/`` and reads the store; nothing below it imports it.
The package itself imports nothing, so importing one submodule stays light (``rich`` is
imported only when a table is drawn on a terminal).
"""
