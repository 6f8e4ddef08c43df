"""A torchrl SAC loop on PendulumEnv, eager and graphed: frames per second.

torchrl's ``Collector`` drives the policy (a ``ProbabilisticActor``) in ``PendulumEnv``, an
environment written in torch (no simulator to download); a ``ReplayBuffer`` on the device
feeds ``SACLoss`` updates (two Q-networks, the entropy temperature, one capturable Adam, the
target networks' ``SoftUpdate``), one update per collected frame, LeanRL-style.

Graphed, the policy is wrapped in ``CudaGraphModule`` (the collector trusts it as it trusts
tensordict's class: no flag to pass) and the whole update (loss, backward, ``step()``, the
soft update) is captured as one graph. The script first checks that a graphed update tracks
an eager twin on the same batches, then runs the loop once per variant and prints frames
per second (``--variants``: eager, compile, tensordict, cudagraph_td, cudagraph_td+compile).
Without CUDA it checks on the library's CPU emulation and runs the eager loop alone.

    pip install torchrl
    python examples/torchrl_sac.py --frames 4000
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from typing import Any

import tensordict.nn
import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential
from torch import nn

try:
    from torchrl.collectors import Collector
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.envs import PendulumEnv
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import SACLoss, SoftUpdate
except ImportError as err:  # pragma: no cover - what a user without torchrl sees
    raise SystemExit(f"this example needs torchrl (`pip install torchrl`): {err}") from err

from cudagraph_td import CudaGraphModule, capturable_on_cpu

HIDDEN, BATCH, FRAMES_PER_BATCH = 256, 256, 50
VARIANTS = ("eager", "compile", "tensordict", "cudagraph_td", "cudagraph_td+compile")


class Observation(nn.Module):
    """PendulumEnv's angle and speed as an observation: (cos, sin, speed)."""

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return torch.stack([th.cos(), th.sin(), thdot], -1)


def agent(device: torch.device) -> tuple[ProbabilisticActor, SACLoss, SoftUpdate]:
    torch.manual_seed(0)
    net = nn.Sequential(MLP(3, 2, num_cells=[HIDDEN, HIDDEN]), NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictSequential(
            TensorDictModule(Observation(), in_keys=["th", "thdot"], out_keys=["observation"]),
            TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        ),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        # Bounds as tensors on the device: from numbers, TanhNormal would copy them there at
        # each call, which no capture admits.
        distribution_kwargs={
            "low": torch.tensor(-2.0, device=device),
            "high": torch.tensor(2.0, device=device),
        },
    ).to(device)
    qvalue = ValueOperator(
        MLP(4, 1, num_cells=[HIDDEN, HIDDEN]), in_keys=["observation", "action"]
    ).to(device)
    loss = SACLoss(actor, qvalue, num_qvalue_nets=2, target_entropy=-1.0)
    loss.make_value_estimator(gamma=0.99)
    return actor, loss, SoftUpdate(loss, tau=0.005)


def make_update(
    loss: SACLoss, updater: SoftUpdate, device: torch.device, graphed: bool = True
) -> Callable[..., Any]:
    # A graph needs `capturable=True` (which torch takes on the CPU inside the library's
    # emulation only) and a tensor learning rate.
    capturable = graphed or device.type == "cuda"
    lr = torch.tensor(3e-4, device=device) if capturable else 3e-4
    optimizer = torch.optim.Adam(loss.parameters(), lr=lr, capturable=capturable)

    def update(batch: TensorDict) -> TensorDict:
        optimizer.zero_grad(set_to_none=False)
        losses = loss(batch)
        (losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]).backward()
        optimizer.step()
        updater.step()  # the target Q-networks, in place
        return losses.select("loss_actor", "loss_qvalue", "loss_alpha").detach()

    return update


def wrap(variant: str, fn: Any, backend: str, warmup: int = 3) -> Any:
    """``fn`` as ``variant`` runs it (``warmup``: the graphed variants' capturing call)."""
    if variant == "eager":
        return fn
    if variant == "compile":
        return torch.compile(fn)
    if variant == "tensordict":
        return tensordict.nn.CudaGraphModule(fn, warmup=warmup)
    if variant == "cudagraph_td+compile":  # compiling takes its first calls
        return CudaGraphModule(torch.compile(fn), warmup=warmup, backend=backend)  # type: ignore[arg-type]
    return CudaGraphModule(fn, warmup=warmup, backend=backend)  # type: ignore[arg-type]


def check_parity(device: torch.device, backend: str) -> None:
    """A graphed update and an eager twin, on the same batches and random numbers."""
    _, loss, updater = agent(device)
    _, twin, twin_updater = agent(device)
    graphed = CudaGraphModule(make_update(loss, updater, device), warmup=3, backend=backend)  # type: ignore[arg-type]
    eager = make_update(twin, twin_updater, device)
    data = TensorDict(
        th=torch.rand(BATCH) * 6 - 3,
        thdot=torch.randn(BATCH),
        action=torch.rand(BATCH, 1) * 4 - 2,
        next=TensorDict(
            th=torch.rand(BATCH) * 6 - 3,
            thdot=torch.randn(BATCH),
            reward=-torch.rand(BATCH, 1),
            done=torch.zeros(BATCH, 1, dtype=torch.bool),
            terminated=torch.zeros(BATCH, 1, dtype=torch.bool),
            batch_size=[BATCH],
        ),
        batch_size=[BATCH],
    ).to(device)
    data["observation"] = Observation()(data["th"], data["thdot"])  # as the policy writes it
    for i in range(6):  # SACLoss writes into its batch: each update gets a copy
        torch.manual_seed(i)
        got = graphed(data.clone())
        torch.manual_seed(i)
        torch.testing.assert_close(got, eager(data.clone()), rtol=1e-4, atol=1e-5)
    for p, q in zip(loss.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def frames_per_second(
    variant: str, frames: int, device: torch.device, backend: str, warmup: int = 3
) -> float:
    """Run the loop for ``frames`` frames; frames per second after the first two batches
    (warm-ups, captures and compilations)."""
    actor, loss, updater = agent(device)
    policy = wrap(variant, actor, backend, warmup)
    graphed = variant not in ("eager", "compile")
    update = wrap(variant, make_update(loss, updater, device, graphed), backend, warmup)
    env = PendulumEnv(device=device)
    collector = Collector(
        env,
        policy,
        frames_per_batch=FRAMES_PER_BATCH,
        total_frames=frames,
        auto_register_policy_transforms=False,  # the policy needs none
    )
    buffer = ReplayBuffer(storage=LazyTensorStorage(frames, device=device), batch_size=BATCH)
    start, counted = 0.0, 0
    try:
        for i, batch in enumerate(collector):
            if i == 2:  # after the warm-ups and captures
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start, counted = time.perf_counter(), 0
            buffer.extend(batch)
            for _ in range(batch.numel()):  # one update per frame
                update(buffer.sample())
            counted += batch.numel()
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        collector.shutdown()
    return counted / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--variants", default="eager,cudagraph_td", help=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=3, help="the graphed variants' warmup=")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # torchrl's own
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backend = "cuda" if cuda else "emulate"
    if not cuda:
        print("CUDA graphs need CUDA, which this machine lacks: checking on the CPU emulation.")
    with capturable_on_cpu():  # the eager twin steps the same capturable Adam, on the CPU too
        check_parity(device, backend)
    print("graphed SAC updates track the eager twin (losses and parameters)")
    variants = args.variants.split(",") if cuda else ["eager"]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    frames = args.frames if cuda else 300
    where = torch.cuda.get_device_name() if cuda else "cpu; no graph to compare without CUDA"
    print(f"PendulumEnv, SAC, one update of {BATCH} per frame ({where})", flush=True)
    rates: dict[str, float] = {}
    for variant in variants:  # each printed once measured
        try:
            rate = rates[variant] = frames_per_second(variant, frames, device, backend, args.warmup)
        except Exception as err:  # a variant that cannot run this loop says why
            text = f"{type(err).__name__}: {err}"
            if len(text) > 400:  # its start, and its end (where a capture error's cause is)
                text = f"{text[:150]} ... {text[-250:]}"
            print(f"{variant + ':':22} failed: {text}", flush=True)
            continue
        ratio = f" ({rate / rates['eager']:.2f}x eager)" if "eager" in rates else ""
        print(f"{variant + ':':22} {rate:10,.0f} frames/s{ratio}", flush=True)


if __name__ == "__main__":
    main()
