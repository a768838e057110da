"""Bad layouts given to the memory planner (python -m txl_dist.plan): it applies the trainer's layout rules, and its
exit status says whether a layout fits."""

from __future__ import annotations

import pytest


def test_the_planner_refuses_layouts_the_trainer_refuses_and_exits_non_zero_when_none_fits(capsys):
    from txl_dist import plan
    from txl_dist.config import load_config

    base = ["--config", "configs/tiny_cpu.yaml", "--device", "cpu"]
    for args in (
        ["--world-size", "3", "train.micro_batch=null"],
        ["--world-size", "1000000"],
        ["--world-size", "1", "--micro-batch", "3"],
    ):
        with pytest.raises(SystemExit) as exited:
            plan.main(base + args)
        assert exited.value.code == 2
        error = capsys.readouterr().err
        assert "error: " in error and "train.global_batch=8" in error and "memory plan" not in error
    assert plan.main(base + ["--world-size", "2", "--device-memory", "1MiB"]) == 3  # the verdict "does not fit"
    assert "no micro-batch fits" in capsys.readouterr().out
    assert plan.main(base + ["--world-size", "2", "--device-memory", "4GiB"]) == 0
    assert "micro-batch 2 fits" in capsys.readouterr().out

    cfg = load_config(["configs/tiny_cpu.yaml"], ["train.micro_batch=null", "train.global_batch=12"])
    for world_size in (1, 2, 3, 5, 8, 12, 24):
        fit = plan.largest_micro_batch(cfg, world_size, 4 * plan.GiB, "cpu")
        accepted = []
        for micro_batch in range(1, 13):
            try:
                accepted.append(cfg.train.batch_split(world_size, micro_batch))
            except ValueError:
                pass
        if not accepted:
            assert fit.micro_batch is None
        else:
            layout = cfg.train.batch_split(world_size, fit.micro_batch)
            assert (fit.micro_batch, fit.grad_accum) == (layout.micro_batch, layout.grad_accum)
            assert fit.micro_batch * fit.grad_accum * world_size == 12
