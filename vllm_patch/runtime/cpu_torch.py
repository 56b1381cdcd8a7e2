"""Packages that break beside vLLM's ``+cpu`` torch: PyPI's torchvision,
torchaudio and torchcodec are built against PyPI's torch (``operator
torchvision::nms does not exist``), taking transformers and ``vllm.config``
down; PyTorch's CPU index has builds that work. Standard library only (nox)."""

BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
