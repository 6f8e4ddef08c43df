"""CUDA graphs made easy and safe for PyTorch and TensorDict users."""

from ._call.graphed_callables import make_graphed_callables as make_graphed_callables
from ._call.module import CudaGraphModule as CudaGraphModule
from ._call.verify import VerificationError as VerificationError
from ._capture.default_backend import set_default_backend as set_default_backend
from ._capture.sharing import capture_stream as capture_stream
from ._compat import capturable_on_cpu as capturable_on_cpu
from ._errors.inputs import InputKeyError as InputKeyError
from ._errors.inputs import InputMismatchError as InputMismatchError
from ._errors.shapes import GraphLimitWarning as GraphLimitWarning
from ._shapes.graphs import GraphInfo as GraphInfo
from ._shapes.options import Buckets as Buckets
from ._shapes.options import Exact as Exact
from ._shapes.options import Static as Static
from ._state.state import RecaptureWarning as RecaptureWarning
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
    "set_default_backend",
]
