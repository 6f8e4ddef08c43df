"""Capture and backends: a graph's life from warm-up to replay (``graph``), the captured call
and its checked replay (``captured``), the autograd core (``autograd``), CUDA graphs and the
emulation's seam (``backend``), what ``backend="auto"`` picks (``default_backend``), what the
wrappers on one device share (``sharing``), graphs per device (``devices``) and
DistributedDataParallel (``distributed``).
"""
