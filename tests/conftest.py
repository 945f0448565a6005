"""The tests price with the built-in cost table, so that no choice of `auto` depends on
the machine they run on (`attnkit.calibrate`); `tests/test_calibrate.py` measures.

`ATTNKIT_TEST_CALIBRATION=on` runs them priced by the table measured here instead (the
exactness matrices must pass either way; tests of `auto`'s choices assume the built-in
table and may then differ).
"""

from __future__ import annotations

import os

if os.environ.get("ATTNKIT_TEST_CALIBRATION", "off") != "on":
    os.environ["ATTNKIT_CALIBRATION"] = "off"
