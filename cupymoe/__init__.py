"""cupymoe: a Mixture-of-Experts layer for LLM inference on NVIDIA GPUs.

Raw CUDA C++ kernels (cuda/*.cu) compiled by NVRTC and launched through CuPy on the
caller's stream; see README.md and docs/DESIGN.md.
"""

from .config import MoeConfig
from .errors import (ActivationNotKeptError, ArenaError, BufferTooSmallError, CheckpointError, CheckpointFileError,
                     ConfigError, CudaUnavailableError, DenseLayerError, Error, GuardError, KernelBuildError,
                     LaunchError, LoraError, MissingConfigKeyError, MissingTensorError, MoeCallError, OptionError,
                     ParallelError, PathUnavailableError, TmaError, UnsupportedFormatError, UnsupportedModelError,
                     VerifyError, WeightError, WorkspaceError)
from .host_weights import HostWeights

__version__ = "0.1.0"

__all__ = [
    "MoeConfig", "HostWeights", "MoeLayer", "Workspace",
    "Error", "ConfigError", "UnsupportedModelError", "DenseLayerError", "OptionError", "CheckpointError",
    "MissingTensorError", "CheckpointFileError", "WeightError", "UnsupportedFormatError", "CudaUnavailableError",
    "KernelBuildError", "LaunchError", "TmaError", "WorkspaceError", "ArenaError", "BufferTooSmallError", "GuardError",
    "MoeCallError", "PathUnavailableError", "LoraError", "ActivationNotKeptError", "MissingConfigKeyError",
    "VerifyError", "ParallelError",
]


def __getattr__(name):
    # MoeLayer and Workspace need CuPy; importing them lazily keeps the host-side package
    # (config, formats, reference, checkpoint) usable on machines without a GPU stack.
    if name == "MoeLayer":
        from .layer import MoeLayer

        return MoeLayer
    if name == "Workspace":
        from .workspace import Workspace

        return Workspace
    if name in _SUBMODULES:  # cupymoe.reference.moe_forward(...) after a plain `import cupymoe`
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'cupymoe' has no attribute {name!r}")


# the host-side modules the public calls live in (docs/DESIGN.md section 5), imported on first use
_SUBMODULES = ("checkpoint", "lora", "reference", "formats", "verify", "testing", "integrations")
