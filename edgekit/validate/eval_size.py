"""How many held-out samples a validation gate may be decided on.

A gate (top-1 agreement, cosine, accuracy drop) decided on a handful of samples says little: on 4
samples one flipped answer moves agreement by 25 points. Fewer than ``WARN_BELOW`` samples is a
warning that names the number; fewer than ``REFUSE_BELOW`` is refused before any conversion
unless the caller allows it (``--allow-small-eval``).
"""

from __future__ import annotations

import warnings

from edgekit.errors import CalibrationDataError, EdgekitWarning

WARN_BELOW = 50
REFUSE_BELOW = 10
HOLDOUT_EVERY = 5  # edgekit.validate.calib.split_holdout: every 5th calibration sample


def check_eval_size(samples: int, held_out: bool, allow_small: bool) -> None:
    """Refuse (``CalibrationDataError``) or warn (``EdgekitWarning``) when ``samples`` held-out
    samples would decide the gate. ``held_out``: they were split off the calibration data (the
    advice then says how much calibration data gives enough)."""
    if samples >= WARN_BELOW:
        return
    more = (
        f"give --eval data with {WARN_BELOW} or more samples, or --calib data with {WARN_BELOW * HOLDOUT_EVERY} "
        f"or more (every {HOLDOUT_EVERY}th sample is held out)"
        if held_out
        else f"give --eval data with {WARN_BELOW} or more samples"
    )
    what = f"{samples} held-out sample{'' if samples == 1 else 's'}"
    if samples < REFUSE_BELOW and not allow_small:
        raise CalibrationDataError(
            f"the validation gate would be decided on {what} (fewer than {REFUSE_BELOW}); {more}, "
            "or pass --allow-small-eval"
        )
    warnings.warn(
        f"the validation gate is decided on {what} (fewer than {WARN_BELOW}), too few to trust its numbers; {more}",
        EdgekitWarning,
        stacklevel=3,
    )
