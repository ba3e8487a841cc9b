"""Library defaults of the age-aware outer step, kept free of torch so a configuration can read them.

Chosen by the delay sweep (bench/delay_sweep.py; the evidence is in docs/RESULTS.md). The outer lr
is scale-dependent: Adam moves every coordinate by about lr per step, so it should be of the
order of a pseudo-gradient's typical coordinate (roughly H × inner lr / 2).
"""

DEFAULT_LR = 1e-2
# --outer-lr auto for the Adam family: this many times H × inner lr, the most any coordinate can
# move in a round's inner steps (inner Adam moves each by at most about its lr per step)
AUTO_LR_SCALE = 0.5
DEFAULT_ALPHA = 0.6
DEFAULT_CUTOFF = 4.0
