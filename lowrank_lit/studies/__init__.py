"""Studies that compare several methods on one benchmark, with their result tables.

A study is one module here with a ``summary(roots, out=None, ...)`` function, which ``lowrank summarize <name>``
finds by the module's name, the way a method's summary is found through its registration. Studies sit under
``methods`` in the package order: the methods' own summaries use the tables built here, and a study imports no
method (it tells methods apart by their configs).

- :mod:`~lowrank_lit.studies.peft_bench`: the PEFT benchmark (docs/peft_bench.md).
- :mod:`~lowrank_lit.studies.prompt_runs`: the table of frozen-backbone tuning runs used by capt, lope and pt_moe.
- :mod:`~lowrank_lit.studies.optimizer_bench`: the byte-level Llama that is_lowrank and nanoadam are timed on.
"""
