"""cupymoe: a Mixture-of-Experts layer for LLM inference on NVIDIA GPUs.

Raw CUDA C++ kernels (cuda/*.cu) compiled by NVRTC and launched through CuPy on the
caller's stream; see README.md and docs in ../shared/docs/DESIGN.md.
"""

from .config import DenseLayerError, MoeConfig, UnsupportedModelError
from .host_weights import HostWeights

__version__ = "0.1.0"

__all__ = ["MoeConfig", "HostWeights", "DenseLayerError", "UnsupportedModelError", "MoeLayer"]


def __getattr__(name):
    # MoeLayer needs CuPy; importing it lazily keeps the host-side package (config,
    # formats, reference, checkpoint) usable on machines without a GPU stack.
    if name == "MoeLayer":
        from .layer import MoeLayer

        return MoeLayer
    raise AttributeError(f"module 'cupymoe' has no attribute {name!r}")
