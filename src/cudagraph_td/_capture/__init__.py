"""Capture and backends: a graph's life from warm-up to replay (``graph``), the autograd core
(``autograd``), CUDA graphs and the emulation's seam (``backend``), what the wrappers on one
device share (``sharing``), graphs per device (``devices``), DistributedDataParallel
(``distributed``) and ``make_graphed_callables`` (``graphed_callables``).
"""
