"""dmbench: the benchmark harness behind bench/run.

Modules: system (processes, page cache, machine info), datasets (generated
test data), core (context, tools, workloads, the engine), tools (dmover and
its peers), wanem (emulated WAN link), workloads (the suite), report
(RESULTS.md and results.json).
"""
