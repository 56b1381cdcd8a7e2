"""vllm-patch's jobs above the engine (``patcher``): the command line
(``cli``), the runtime the measurements share (``runtime``), the measurements
(``bench``), the environment check (``doctor``) and the upstream pull request
(``upstream``). See ARCHITECTURE.md for the order in which they import."""
