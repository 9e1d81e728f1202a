"""dmbench: the benchmark harness behind bench/run.

Modules: system (processes, page cache, installation, machine info),
datasets (generated test data), core (context, tools, workloads, the engine
with tuning and interleaved runs), servers (dmover, GridFTP, rsync and
iperf3 servers), usage (CPU and memory of clients and servers, link
sampling), tools (dmover and its peers), wanem (emulated WAN link), profile
(perf profiles of dmover), workloads (the suite), report (RESULTS.md and
results.json), plots (PNG figures).
"""
