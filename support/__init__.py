"""kvstage.support: the code the tests and the examples share (support/ in the repository).

The clusters of real processes (cluster.py: a bootstrap server and rank processes; etcd_cluster.py,
mooncake_master.py), the rank programs and their data patterns (pd_rank.py, layerwise_rank.py,
kv_pattern.py, pool_pattern.py, draft_pattern.py), the benchmarks' and reports' code (bench*.py,
hop_report.py, layerwise_report.py, figure_legend.py, gpu_check.py, trace_request.py) and the
SGLang/vLLM server harness (sglang_servers.py, vllm_servers.py, vllm_proxy.py).

Contract, checked by tests/unit/test_support_boundaries.py and lint's import contract:
  - the tests and examples/ import shared code from here; no file of examples/ imports a module
    of tests/, and no test imports a module of examples/ (running one as a process is fine);
    neither side edits sys.path to reach the other;
  - the scripts one runs stay in examples/ (examples/pd_rank.py, examples/bench.py, ...): a few
    lines that call this package's main();
  - the product (transfer/, staging/, bootstrap/, adapters/, storage/, sim/, wire.py, ...) never
    imports kvstage.support, and the package is not part of the installed distribution
    (pyproject.toml's packages): it is used from a checkout, as the tests and examples are.
"""
