"""rl.metrics: the plot's KL panel shows the KL only when the run computed one, else the entropy."""

from __future__ import annotations

from rl.metrics import PLOTTED, _panel


def test_the_kl_panel_falls_back_to_the_entropy_when_no_kl_was_computed():
    label = dict(PLOTTED)["kl"]
    no_reference = [{"kl": 0.0, "entropy": 1.5}, {"kl": 0.0, "entropy": 1.2}]
    assert _panel(no_reference, "kl", label)[0] == "entropy"
    assert _panel([{"entropy": 1.0}], "kl", label)[0] == "entropy"  # no KL key at all
    with_reference = [{"kl": 0.0, "entropy": 1.5}, {"kl": 0.01, "entropy": 1.2}]  # 0 at the first step
    assert _panel(with_reference, "kl", label) == ("kl", label)
    assert _panel(no_reference, "maxvio", "MaxVio") == ("maxvio", "MaxVio")  # no fallback: kept as is
