"""The CPU emulation behind ``backend="emulate"``, reached through its one seam in
``_capture.backend``: a capture recorded as ATen operations and replayed without Python
(``recording``), what the recording sees above the dispatcher (``host_calls``), and a CUDA
capture in progress as torch's Python API answers the recording thread (``capturing``).
"""
