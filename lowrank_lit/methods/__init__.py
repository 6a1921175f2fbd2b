"""One module per paper (see ``DESIGN.md``). Each registers itself with
:func:`lowrank_lit.registry.register_method`; ``lowrank list`` imports them all."""
