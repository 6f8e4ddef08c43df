"""CUDA graphs made easy and safe for PyTorch and TensorDict users."""

from ._compat import capturable_on_cpu as capturable_on_cpu
from ._errors import InputKeyError as InputKeyError
from ._errors import InputMismatchError as InputMismatchError
from ._errors_shapes import GraphLimitWarning as GraphLimitWarning
from ._graphed_callables import make_graphed_callables as make_graphed_callables
from ._module import CudaGraphModule as CudaGraphModule
from ._shape_options import Buckets as Buckets
from ._shape_options import Exact as Exact
from ._shape_options import Static as Static
from ._shapes import GraphInfo as GraphInfo
from ._sharing import capture_stream as capture_stream
from ._state import RecaptureWarning as RecaptureWarning
from ._verify import VerificationError as VerificationError
from ._version import __version__ as __version__

__all__ = [
    "Buckets",
    "CudaGraphModule",
    "Exact",
    "GraphInfo",
    "GraphLimitWarning",
    "InputKeyError",
    "InputMismatchError",
    "RecaptureWarning",
    "Static",
    "VerificationError",
    "__version__",
    "capturable_on_cpu",
    "capture_stream",
    "make_graphed_callables",
]
