"""The learning rate as a function of the optimizer step.

``step`` counts the optimizer steps already taken (0 before the first update); `learning_rate` gives the rate of
the next update. With W = warmup_steps, T = the schedule's total steps, peak = optim.lr, floor = min_lr:

- warmup (step < W): ``peak * step / W`` (from 0, as the authors' ``lr * train_step / warmup_step``);
- cosine: ``floor + (peak - floor) * (1 + cos(pi * step / T)) / 2`` for W <= step <= T, then ``floor``. The
  cosine is of the absolute step over T, warmup included: the authors call ``CosineAnnealingLR(opt, max_step,
  eta_min).step(train_step)`` once warmup is over;
- inv_sqrt: ``max(floor, peak * sqrt(max(W, 1) / step))`` for step >= W (1 at step 0 when W = 0). This is the
  authors' ``1 / sqrt(step)`` after warmup scaled by sqrt(W) so that it peaks at optim.lr: their peak is
  lr / sqrt(W), so their lr L corresponds to optim.lr = L / sqrt(W) here;
- constant: ``peak``.

DeepSpeed steps the scheduler once per optimizer step. Give it the factory so that it builds the scheduler on
the optimizer it creates::

    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config,
        lr_scheduler=lambda optimizer: build_lr_scheduler(optimizer, cfg.schedule, cfg.train.max_steps))
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from txl_dist.config import ScheduleConfig


def learning_rate(step: int, peak_lr: float, schedule: ScheduleConfig, max_steps: int) -> float:
    """The learning rate of the update after ``step`` optimizer steps (see the module docstring)."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak_lr * step / warmup
    if schedule.kind == "constant":
        return peak_lr
    floor = schedule.min_lr
    if schedule.kind == "cosine":
        total = schedule.resolved_total_steps(max_steps)
        progress = min(step, total) / total
        return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule.kind == "inv_sqrt":
        return max(floor, peak_lr * math.sqrt(max(warmup, 1) / max(step, 1)))
    raise ValueError(f"schedule.kind={schedule.kind!r} is not allowed: one of ['cosine', 'inv_sqrt', 'constant']")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, schedule: ScheduleConfig, max_steps: int) -> LambdaLR:
    """A LambdaLR that sets each parameter group's rate to `learning_rate` with the group's own lr as the peak.

    The multipliers are closures, so the scheduler's state_dict holds only its step count and base rates: a
    resumed run rebuilds the same curve from its config and continues at the saved step."""

    def multiplier_for(peak_lr: float):
        peak = [peak_lr]  # `set_peak` moves it; a function's state is not in the scheduler's state_dict

        def multiplier(step: int) -> float:
            return learning_rate(step, peak[0], schedule, max_steps) / peak[0] if peak[0] > 0 else 0.0

        multiplier.peak = peak
        return multiplier

    peaks = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
    return LambdaLR(optimizer, [multiplier_for(peak) for peak in peaks])


def set_peak(scheduler: LambdaLR, peak: float) -> float:
    """The curve's peak set to ``peak`` (optim.lr, times the factors of the data windows a run skipped), the next
    update's rate with it; returns the peak the scheduler held. A checkpoint's scheduler state holds the peak it was
    saved with (``base_lrs``): a resumed or rolled-back run sets its own, so that a changed optim.lr applies from
    the step it resumes at."""
    before = scheduler.base_lrs[0]
    scheduler.base_lrs = [peak] * len(scheduler.base_lrs)
    for group, multiplier in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        multiplier.peak[0] = peak  # the curve of this peak, its floor schedule.min_lr
        group["lr"] = peak * multiplier(scheduler.last_epoch)
    return before
