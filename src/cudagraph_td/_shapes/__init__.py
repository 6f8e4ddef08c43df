"""``shapes=``: the graphs of one mode and the one place that picks a graph by the call's key
(``graphs``), the values of ``shapes=`` (``options``), calls padded to a bucket (``buckets``),
batch dims read, padded and sliced back (``padding``), and the padding checked (``row_check``).
"""
