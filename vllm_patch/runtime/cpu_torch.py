"""Beside vLLM's ``+cpu`` torch, PyPI's builds of these fail to load (``operator
torchvision::nms does not exist``), taking transformers and ``vllm.config`` down;
PyTorch's CPU index has builds that work. Standard library only (nox)."""

BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
