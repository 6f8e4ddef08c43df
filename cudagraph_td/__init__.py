"""CUDA graphs made easy and safe for PyTorch and TensorDict users."""

from ._module import CudaGraphModule as CudaGraphModule
from ._version import __version__ as __version__

__all__ = ["CudaGraphModule", "__version__"]
