"""Studies that compare several methods on one benchmark, with their result tables.

A study is one module here. One with a result table registers its summary in that module
(``@register_study("<name>")`` on ``summary(roots, out=None, ...)``, :func:`lowrank_lit.registry.register_study`), and
``lowrank summarize <name>`` finds it in the checked-in index without importing the study, the way a method's
summary is found through its registration. Studies sit under ``methods`` in the package order: the methods' own
summaries use the tables built here, and a study imports no method (it uses the shared layers of ``nn/`` and tells
methods apart by their configs).

- :mod:`~lowrank_lit.studies.peft_suite`: the PEFT suite (docs/peft_suite.md).
- :mod:`~lowrank_lit.studies.prompt_runs`: the table of frozen-backbone tuning runs used by capt, lope and pt_moe.
- :mod:`~lowrank_lit.studies.optimizer_bench`: the byte-level Llama that is_lowrank and nanoadam are timed on.
- :mod:`~lowrank_lit.studies.compress_adapt_merge`: GLVQ (or RTN) quantization, LoRA adaptation, merge and
  re-quantization in one run (docs/compose.md).
"""
