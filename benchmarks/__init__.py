"""weightsync's benchmark harness: the library's patch and bucket paths against a
safetensors file and a gloo broadcast, all run for real in one run, with the entropy
floor and RLinf's format as byte references.

    python -m benchmarks --suite quick|full --json OUT.json [--plot OUT.png]

Modules: ``workloads`` (real AdamW steps, synthetic ulp changes), ``floor`` (entropy
floor, RLinf's format), ``bandwidth`` (memory copy, raw ZeroMQ), ``e2e`` (one
workload through every path), ``peers`` (safetensors and gloo worker processes),
``memory`` (peak RSS of sender and receivers in their own processes), ``report``
(targets, table, plot). ``encodings`` is a standalone micro-benchmark of the codecs.
"""
