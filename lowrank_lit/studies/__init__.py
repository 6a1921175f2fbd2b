"""Studies that compare several methods on one benchmark, with their result tables.

A study is one module here; one with a ``summary(roots, out=None, ...)`` function is a line of :data:`STUDIES`, which
``lowrank summarize <name>`` reads (without importing the study), the way a method's summary is found through its
registration. Studies sit under
``methods`` in the package order: the methods' own summaries use the tables built here, and a study imports no
method (it tells methods apart by their configs).

- :mod:`~lowrank_lit.studies.peft_bench`: the PEFT benchmark (docs/peft_bench.md).
- :mod:`~lowrank_lit.studies.prompt_runs`: the table of frozen-backbone tuning runs used by capt, lope and pt_moe.
- :mod:`~lowrank_lit.studies.optimizer_bench`: the byte-level Llama that is_lowrank and nanoadam are timed on.
"""

#: the studies ``lowrank summarize <name>`` runs: name -> dotted path of the summary function (a study with a summary
#: adds its line here; a test checks that every study module's ``summary`` is listed)
STUDIES: dict[str, str] = {
    "peft_bench": "lowrank_lit.studies.peft_bench.summary",
}
