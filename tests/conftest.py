"""The tests price with the built-in cost table, so that no choice of `auto` depends on
the machine they run on (`attnkit.calibrate`); `tests/test_calibrate.py` measures."""

from __future__ import annotations

import os

os.environ["ATTNKIT_CALIBRATION"] = "off"
