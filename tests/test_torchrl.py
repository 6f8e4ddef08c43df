"""With the real torchrl (the CI environment beside torchrl 0.14.1; skipped without it)."""

from __future__ import annotations

import pytest
import torch
from tensordict.nn import TensorDictModule
from torch import nn

from .conftest import Backend

torchrl = pytest.importorskip("torchrl")
from torchrl.collectors import Collector  # noqa: E402
from torchrl.envs import PendulumEnv  # noqa: E402


class _Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.stack([th, thdot], -1))


def test_a_collector_trusts_a_graphed_policy(backend: Backend) -> None:
    # torchrl trusts instances of tensordict's CudaGraphModule, which this one subclasses:
    # no `trust_policy=True` to pass, and the collector calls it as it is.
    env = PendulumEnv(device=backend.device)
    policy = TensorDictModule(
        _Policy().to(backend.device), in_keys=["th", "thdot"], out_keys=["action"]
    )
    graphed = backend.wrap(policy, warmup=2)
    collector = Collector(env, graphed, frames_per_batch=20, total_frames=100)
    try:
        assert collector.trust_policy
        batches = list(collector)
    finally:
        collector.shutdown()
    assert len(batches) == 5
    for batch in batches:
        with torch.no_grad():
            expected = policy(batch.select("th", "thdot").clone())["action"]
        torch.testing.assert_close(batch["action"], expected)
    # The collector's mode (no_grad, its exploration type): a graph captured and replayed.
    assert any(info.captured and info.replays for info in graphed.graphs())
