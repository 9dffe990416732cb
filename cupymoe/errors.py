"""Every error cupymoe raises: `cupymoe.Error` is their root.

Each class also derives from the built-in exception callers caught before this hierarchy
existed (ValueError, KeyError, NotImplementedError, RuntimeError, FileNotFoundError), so
`except ValueError` code keeps working. Messages name the offending value and what would
be accepted.
"""

from __future__ import annotations


class Error(Exception):
    """Root of every error cupymoe raises."""


# --- configuration and options ---------------------------------------------------------

class ConfigError(Error, ValueError):
    """A MoeConfig field or a config.json value out of range."""


class MissingConfigKeyError(ConfigError, KeyError):
    """config.json lacks a key the family needs. Also a KeyError, so `except KeyError` callers keep working."""

    def __str__(self) -> str:  # KeyError would print the message repr-quoted
        return str(self.args[0]) if self.args else ""


class UnsupportedModelError(ConfigError):
    """The config's model_type (or a size) is not one cupymoe can map or serve."""


class DenseLayerError(ConfigError):
    """The requested layer index is a dense (non-MoE) MLP layer in this model."""


class OptionError(Error, ValueError):
    """A bad keyword option or CUPYMOE_* environment knob."""


class ActivationNotKeptError(OptionError):
    """A check read the bf16 activation of a w8a8 prefill forward that did not store it: build the
    layer with keep_w8a8_activation=True (verify's checks do)."""


# --- checkpoints and weights -------------------------------------------------------------

class CheckpointError(Error, ValueError):
    """The checkpoint (or tensor mapping) does not hold what the layer needs; the message says what."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the layer needs is absent. Also a KeyError, so `except KeyError` callers keep working."""

    def __str__(self) -> str:  # KeyError would print the message repr-quoted
        return str(self.args[0]) if self.args else ""


class CheckpointFileError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs (config.json, the weights, a shard the index names) does not exist."""


class WeightError(Error, ValueError):
    """Weights the layer cannot use as given: a wrong shape, a non-finite value, a bad scale."""


class UnsupportedFormatError(Error, NotImplementedError):
    """A weight format or width the GPU kernels do not serve; names the tensor and format."""


# --- device and kernels -------------------------------------------------------------------

class CudaUnavailableError(Error, RuntimeError):
    """No usable CUDA device / CuPy installation for a GPU operation."""


class KernelBuildError(Error, RuntimeError):
    """NVRTC rejected a module; the message carries its log."""


class LaunchError(Error, RuntimeError):
    """The driver refused a launch or a stream operation; names the kernel and the CUresult."""


class TmaError(Error, RuntimeError):
    """The driver refused a tensor map (its arguments are in the message)."""


# --- scratch ----------------------------------------------------------------------------

class WorkspaceError(Error, ValueError):
    """A workspace too small for a layer, on another device, or used in a way that would race."""


class ArenaError(WorkspaceError):
    """A bad scratch plan: unknown stage or buffer, or two live buffers sharing bytes."""


class BufferTooSmallError(WorkspaceError):
    """A request larger than the buffer planned for it."""


class ParallelError(Error, RuntimeError):
    """Expert parallelism that cannot go on: a rank failed or died, or a closed communicator was used."""


class GuardError(Error, RuntimeError):
    """Guard mode (CUPYMOE_GUARD=1): a kernel wrote into a red zone of the workspace; names the buffer before it."""


class VerifyError(Error, RuntimeError):
    """cupymoe.verify could not set a check up (e.g. no input rows drawn clear of the routing margin)."""


# --- calls ----------------------------------------------------------------------------

class MoeCallError(Error, ValueError):
    """A forward call refused before anything was launched; names the problem and values."""


class PathUnavailableError(Error, ValueError):
    """A forced path that cannot serve this layer or call."""


class LoraError(Error, ValueError):
    """An adapter the layer cannot serve: a rank over the reserved one, a module it cannot place."""
