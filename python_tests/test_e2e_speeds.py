"""The e2e trainers' balanced modes plan with each rank's measured speed (E2EConfig.balance_speeds,
`freescale-bench e2e --no-speeds` to plan on load alone): what a rank computed per second of its
compute since the last plan, averaged with the speed before, reaches LoadBalancer.speed before
the next dispatch. Checked by what is measured and passed on, never by how fast anything ran."""

import json
from types import SimpleNamespace

import pytest
import torch

from freescale_comm.bench import cli, e2e
from freescale_comm.bench.e2e_config import MODES, home_batch
from freescale_comm.bench.e2e_trainer import StepTrainer
from freescale_comm.planner import CostModel

CM = CostModel(quadratic=1.0, linear=2.0, constant=3.0)
CFG = dict(ranks=2, samples=4, length_scale=1 / 64, dim=16, rows_per_rank=64, groups=2)


class _StubBalancer:
    """LoadBalancer's part the trainer uses: dispatch (samples stay home) and speed."""

    def __init__(self) -> None:
        self.speed = 1.0

    def dispatch(self, ids, lengths):
        return SimpleNamespace(values=ids, lengths=lengths)


def _computed(trainer: StepTrainer, lengths: list[int]) -> None:
    x = torch.randn(sum(lengths), trainer.cfg.dim)
    trainer.forward_backward(x, torch.arange(sum(lengths)), lengths, 2, "forward_backward")


@pytest.mark.parametrize("speeds", [True, False])
def test_the_speed_a_rank_computed_at_reaches_its_balancer_before_the_next_plan(speeds):
    trainer = StepTrainer(e2e.E2EConfig(**CFG, balance_speeds=speeds), MODES["balance"], 0, CM, None)
    trainer.balancer = _StubBalancer()
    _computed(trainer, [3, 5, 1])
    cost, seconds = trainer._measured
    assert cost == float(CM.cost([3, 5, 1]).sum()) and seconds > 0
    trainer.samples(0)
    assert trainer.balancer.speed == (pytest.approx(cost / seconds) if speeds else 1.0)
    assert trainer._measured == ([0.0, 0.0] if speeds else [cost, seconds])
    if not speeds:
        return
    first = trainer.balancer.speed
    _computed(trainer, [7, 2])
    cost, seconds = trainer._measured
    trainer.samples(1)
    assert trainer.balancer.speed == pytest.approx((first + cost / seconds) / 2)  # averaged with the one before
    second = trainer.balancer.speed
    trainer.samples(2)  # nothing computed since: the speed stays
    assert trainer.balancer.speed == second
    assert len(trainer.computed) == 3 and trainer.computed[0] == home_batch(trainer.cfg, 0, 0)[1].numel()


def test_the_cli_plans_on_load_alone_with_no_speeds(tmp_path):
    out = tmp_path / "e2e.json"
    assert cli.main(["e2e", "--ranks", "2", "--steps", "1", "--warmup", "0", "--samples", "2", "--length-scale", "0.01",
                     "--dim", "16", "--modes", "balance", "--json", str(out), "--no-progress", "--no-speeds"]) == 0
    assert json.loads(out.read_text())["config"]["balance_speeds"] is False
    assert e2e.E2EConfig().balance_speeds is True
