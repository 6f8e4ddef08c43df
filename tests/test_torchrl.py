"""With the real torchrl (the CI environment beside torchrl 0.14.1; skipped without it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn

from .conftest import Backend

torchrl = pytest.importorskip("torchrl")
from torchrl.collectors import Collector  # noqa: E402
from torchrl.envs import PendulumEnv  # noqa: E402
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator  # noqa: E402
from torchrl.objectives import ClipPPOLoss, SACLoss, SoftUpdate  # noqa: E402


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


def _actor(device: torch.device) -> ProbabilisticActor:
    net = nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[32]), NormalParamExtractor())
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    # TanhNormal's bounds as tensors on the device: from numbers, it would copy them there at
    # each call, which no capture admits. (Its Monte-Carlo entropy also keeps ClipPPOLoss off
    # its host check of an analytic entropy, in torchrl 0.14.)
    bounds = {"low": torch.tensor(-1.0, device=device), "high": torch.tensor(1.0, device=device)}
    return ProbabilisticActor(
        module,
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs=bounds,
        return_log_prob=True,
    ).to(device)


def _sac(device: torch.device) -> tuple[Any, Any]:
    actor = _actor(device)
    qvalue = ValueOperator(
        MLP(in_features=4, out_features=1, num_cells=[32]), in_keys=["observation", "action"]
    ).to(device)
    loss = SACLoss(actor, qvalue, num_qvalue_nets=2, target_entropy=-1.0)
    loss.make_value_estimator(gamma=0.99)
    return loss, SoftUpdate(loss, tau=0.05)


def _ppo(device: torch.device) -> tuple[Any, Any]:
    critic = ValueOperator(
        MLP(in_features=3, out_features=1, num_cells=[32]), in_keys=["observation"]
    )
    loss = ClipPPOLoss(_actor(device), critic.to(device), entropy_coeff=0.01)
    return loss, None


def _batch(device: torch.device, n: int = 64) -> TensorDict:
    td = TensorDict(
        observation=torch.randn(n, 3),
        action=torch.rand(n, 1) * 2 - 1,
        action_log_prob=torch.randn(n, 1) - 1,
        advantage=torch.randn(n, 1),
        value_target=torch.randn(n, 1),
        next=TensorDict(
            observation=torch.randn(n, 3),
            reward=torch.randn(n, 1),
            done=torch.zeros(n, 1, dtype=torch.bool),
            terminated=torch.zeros(n, 1, dtype=torch.bool),
        ),
        batch_size=[n],
    )
    return td.to(device)


def _update(loss: Any, updater: Any, device: torch.device, capturable: bool) -> Any:
    lr = torch.tensor(3e-3, device=device) if capturable else 3e-3
    optimizer = torch.optim.Adam(loss.parameters(), lr=lr, capturable=capturable)

    def update(batch: TensorDict) -> TensorDict:
        optimizer.zero_grad(set_to_none=False)
        losses = loss(batch)
        total = sum(value for key, value in losses.items() if key.startswith("loss_"))
        total.backward()
        optimizer.step()
        if updater is not None:
            updater.step()  # the target networks, in place
        return losses.detach()

    return update


@pytest.mark.parametrize("make_loss", [_sac, _ppo], ids=["SACLoss", "ClipPPOLoss"])
def test_a_whole_loss_update_matches_its_eager_twin(backend: Backend, make_loss: Any) -> None:
    # The loss, its backward, the optimizer step (and SAC's target update) in one graph;
    # the same random numbers for both (the generator seeded before each update).
    torch.manual_seed(0)
    loss, updater = make_loss(backend.device)
    twin, twin_updater = make_loss(backend.device)
    twin.load_state_dict(loss.state_dict())
    capturable = True  # on the CPU too: the emulation runs capturable optimizers
    graphed = backend.wrap(_update(loss, updater, backend.device, capturable), warmup=3)
    eager = _update(twin, twin_updater, backend.device, capturable)
    for i in range(8):
        batch = _batch(backend.device)
        torch.manual_seed(100 + i)
        got = graphed(batch)
        torch.manual_seed(100 + i)
        want = eager(batch)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(loss.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    assert any(info.captured and info.replays for info in graphed.graphs())
