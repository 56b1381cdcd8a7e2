"""What the jobs share to run code inside a vLLM environment: one child runner
(``child``), one patched copy of vLLM (``patched_copy``), the machine's facts
(``machine``), the user cache (``cache``), a bench result read as data
(``bench_result``), and how vLLM's kernels and imports are checked
(``import_checks``, ``cpu_torch``)."""
