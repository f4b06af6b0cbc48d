"""A stack of small torch FFN layers and injected calibration figures, shared by the tests of the
budget-driven choice (``test_autotune_stack``, ``test_budget_entry_points``)."""
import functools

import torch

from xla_swap.executors.streaming.calibrate import calibration_from_figures
from xla_swap.planning import Link

D, F, L, T = 16, 32, 6, 8
#: Injected figures: streaming a stage's weights and moments over this link takes longer than its
#: compute, so every resident stage shortens the predicted step.
FIGURES = functools.partial(calibration_from_figures, link=Link(h2d_gbps=1e-3, d2h_gbps=1e-3, both_gbps=1.5e-3),
                            forward_s=1e-3, backward_s=2.5e-3)


class FFN(torch.nn.Module):
    """``h + b(gelu(a(h)))``, hidden ``D``, inner ``F``, no biases."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(D, F, bias=False)
        self.b = torch.nn.Linear(F, D, bias=False)

    def forward(self, h):
        return h + self.b(torch.nn.functional.gelu(self.a(h), approximate="tanh"))


def loss(o):
    """The mean square of the stack's output."""
    return (o ** 2).mean()
